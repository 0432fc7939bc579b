"""transformers' cache protocol, whole: every public method and property of HybridIndexPoolCache (its own or inherited
from `Cache`) works with its layers, or raises an error that names what to use instead; every cache layer answers
`get_seq_length`, `get_mask_sizes` and `is_compileable`."""

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache, LinearAttentionLayerCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def refuses(call, error, advice):
    """The call raises `error` whose message names what to use instead (`advice`, a regex)."""
    with pytest.raises(error, match=advice):
        call()
    return True


def filled_cache(model, tokens: int = 11, max_cache_len: int = 20) -> HybridIndexPoolCache:
    cache = HybridIndexPoolCache(model.config, max_cache_len=max_cache_len)
    with torch.no_grad():
        model(torch.randint(3, 97, (2, tokens)), cache=cache)
    return cache


def test_every_public_member_of_the_cache_works_or_names_what_to_use_instead():
    model = tiny_model(num_mtp_layers=1)
    config = model.config
    cache = filled_cache(model)
    linear = config.layer_types.index("linear_attention")
    attention = config.layer_types.index("indexpool_attention")
    last_linear = len(config.layer_types) - 1 - config.layer_types[::-1].index("linear_attention")
    conv_state = cache.layers[linear].conv_states[0]
    checks = {
        # Lengths and sizes.
        "get_seq_length": lambda: cache.get_seq_length() == 11 and cache.get_seq_length(attention) == 11,
        "get_mask_sizes": lambda: cache.get_mask_sizes(3, 0) == (14, 0) == cache.get_mask_sizes(3, attention)
        and refuses(lambda: cache.get_mask_sizes(3, last_linear), ValueError, "does not track sequence length"),
        "get_query_offset": lambda: cache.get_query_offset() == 11,
        "get_max_length": lambda: cache.get_max_length() == 20 and cache.get_max_length(linear) == -1,
        "batch_size": lambda: cache.batch_size == 2,
        "is_initialized": lambda: cache.is_initialized and not HybridIndexPoolCache(config).is_initialized,
        "is_compileable": lambda: cache.is_compileable and not HybridIndexPoolCache(config).is_compileable,
        "is_croppable": lambda: cache.is_croppable,
        "is_sliding": lambda: cache.is_sliding == [False] * len(cache.layers),
        "is_dummy": lambda: cache.is_dummy == [False] * len(cache.layers),
        "is_linear": lambda: [i for i, linear_layer in enumerate(cache.is_linear) if linear_layer] == [
            i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"],
        "layers": lambda: len(cache.layers) == config.num_hidden_layers + config.num_mtp_layers,
        "decoder_layers": lambda: len(cache.decoder_layers) == cache.num_decoder_layers == config.num_hidden_layers,
        "num_decoder_layers": lambda: cache.num_decoder_layers == config.num_hidden_layers,
        "index_layers": lambda: all(isinstance(layer, IndexPoolLayerCache) for layer in cache.index_layers),
        "mtp_layers": lambda: len(cache.mtp_layers) == 1 and cache.mtp_layers[0].get_seq_length() == 0,
        "layout": lambda: cache.layout["layer_types"] == list(config.layer_types),
        "max_cache_len": lambda: cache.max_cache_len == 20,
        "seen_tokens": lambda: int(cache.seen_tokens) == 11,
        "rope_deltas": lambda: cache.rope_deltas is None,
        "layer_class_to_replicate": lambda: cache.layer_class_to_replicate is None,
        "offloading": lambda: cache.offloading is False,
        "memory_footprint": lambda: cache.memory_footprint()["key_value"] > 0,
        # Linear-attention states, as transformers' linear-attention layers give them.
        "get_conv_state": lambda: cache.get_conv_state(linear) is conv_state and refuses(
            lambda: cache.get_conv_state(attention), ValueError, "non linear attention layer"),
        "get_recurrent_state": lambda: cache.get_recurrent_state(linear) is cache.layers[linear].recurrent_states[0],
        "has_previous_state": lambda: cache.has_previous_state() and cache.has_previous_state(linear),
        "update_conv_state": lambda: torch.equal(cache.update_conv_state(conv_state * 1, linear), conv_state),
        "update_recurrent_state": lambda: torch.equal(
            cache.update_recurrent_state(cache.get_recurrent_state(linear) * 1, linear),
            cache.get_recurrent_state(linear)),
        # Writes that the layers own, and what transformers' other caches do that this one does not.
        "update": lambda: refuses(lambda: cache.update(torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8), attention),
                                  ValueError, r"place_windows\(...\) then .update"),
        "update_indexer": lambda: refuses(lambda: cache.update_indexer(torch.zeros(2, 1, 8), attention), ValueError,
                                          "pooled_storage"),
        "increase_count": lambda: refuses(lambda: cache.increase_count(linear, 0), ValueError,
                                          r"cache.positions\(token_is_real\)"),
        "early_initialization": lambda: refuses(lambda: cache.early_initialization(2, 4, 8, torch.float32, "cpu"),
                                                ValueError, r"max_cache_len=N\) and run the prompt's forward"),
        "offload": lambda: refuses(lambda: cache.offload(attention), NotImplementedError, "index_key_cache_dtype"),
        "prefetch": lambda: refuses(lambda: cache.prefetch(attention), NotImplementedError, "index_key_cache_dtype"),
        # Recording and rollback.
        "is_recording_past": lambda: not cache.is_recording_past(linear),
        "get_recurrent_states_to_keep": lambda: cache.get_recurrent_states_to_keep() == 0,
        "activate_past_recording": lambda: cache.activate_past_recording(recurrent_states_to_keep=2) is None
        and cache.is_recording_past(linear) and cache.get_recurrent_states_to_keep() == 2,
        "crop": lambda: cache.crop(0) is None and refuses(lambda: cache.crop(-1), ValueError,
                                                           "activate_past_recording"),
        # Batch operations generate() uses.
        "reorder_cache": lambda: cache.reorder_cache(torch.tensor([1, 0])) is None and cache.batch_size == 2,
        "batch_repeat_interleave": lambda: cache.batch_repeat_interleave(2) is None and cache.batch_size == 4,
        "batch_select_indices": lambda: cache.batch_select_indices(torch.tensor([0, 3])) is None
        and cache.batch_size == 2,
        "reserve": lambda: cache.reserve(30) is None and cache.index_layers[0].capacity >= 30,
        "positions": lambda: cache.positions(torch.ones(2, 3, dtype=torch.bool)).tolist() == [[11, 12, 13]] * 2
        and cache.get_seq_length() == 14,
        "reset": lambda: cache.reset() is None and cache.get_seq_length() == 0 and not cache.is_initialized,
    }
    public = {name for name in dir(cache) if not name.startswith("_")}
    assert public == set(checks), f"unchecked: {sorted(public - set(checks))}, gone: {sorted(set(checks) - public)}"
    for name, check in checks.items():  # in order: the batch operations and reset come last
        assert check(), name


def test_every_cache_layer_answers_its_lengths_and_whether_it_compiles():
    model = tiny_model(num_mtp_layers=1)
    cache = filled_cache(model)
    for index, layer in enumerate(cache.layers):
        decoder = index < cache.num_decoder_layers
        entries = 11 if decoder else 0  # the MTP layer holds nothing until a prompt's forward fills it
        assert layer.get_seq_length() == entries, index
        assert layer.get_mask_sizes(2) == (entries + 2, 0), index
        assert layer.is_compileable, index
        assert isinstance(layer, (LinearAttentionLayerCache, IndexPoolLayerCache))
    cache.activate_past_recording(recurrent_states_to_keep=1)
    assert not any(layer.is_compileable for layer in cache.decoder_layers)


def held_objects(obj, path: str = "cache", seen=None):
    """(path, object) of everything reachable from `obj` through attributes, dicts, lists and tuples (not into
    tensors)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, int, float, str, bool, type(None), torch.dtype)):
        return
    seen.add(id(obj))
    yield path, obj
    children = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple))
                else vars(obj).items() if hasattr(obj, "__dict__") else ())
    for key, child in children:
        yield from held_objects(child, f"{path}.{key}", seen)


def test_no_cache_layer_holds_a_callable_while_recording_after_a_crop_or_after_the_replay():
    """Caches store, layers compute: a crop leaves recorded inputs for the layer to replay, never model code."""
    model = tiny_model(num_mtp_layers=1)
    cache = filled_cache(model)
    held = {}
    with torch.no_grad():
        cache.activate_past_recording(recurrent_states_to_keep=3)
        model(torch.randint(3, 97, (2, 4)), cache=cache)  # recorded
        held["recording"] = list(held_objects(cache))
        cache.crop(-2)
        held["cropped"] = list(held_objects(cache))
        assert any(layer.replay_inputs is not None for layer in cache.decoder_layers
                   if isinstance(layer, LinearAttentionLayerCache))  # the crop left a replay to the layers
        model(torch.randint(3, 97, (2, 1)), cache=cache)  # replays, then runs the new token
        held["replayed"] = list(held_objects(cache))
    for moment, objects in held.items():
        assert len(objects) > len(cache.layers), moment  # the walk reached into the layers
        assert not [path for path, obj in objects if callable(obj)], moment
