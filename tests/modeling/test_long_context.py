"""Long contexts: chunked prefill equals one pass, and a decode step's allocations do not grow with the context."""

import pytest
import torch
from model_factory import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_indexpool import HybridIndexPoolCache
from hybrid_indexpool.kernels.pooled_index_topk import reference as topk_reference
from hybrid_indexpool.modeling.cache_hybrid_indexpool import IndexPoolLayerCache, LinearAttentionLayerCache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def prefill(model, input_ids, attention_mask=None):
    with torch.no_grad():
        output = model(input_ids, attention_mask=attention_mask, use_cache=True)
    return output.logits, output.cache


def assert_same_cache(first: HybridIndexPoolCache, second: HybridIndexPoolCache):
    assert first.get_seq_length() == second.get_seq_length()
    for a, b in zip(first.layers, second.layers):
        if isinstance(a, LinearAttentionLayerCache):
            torch.testing.assert_close(a.conv_states[0], b.conv_states[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], atol=1e-4, rtol=1e-4)
        else:
            assert isinstance(a, IndexPoolLayerCache)
            assert torch.equal(a.lengths, b.lengths)
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)
            pooled_counts, open_counts = (a.lengths // a.pool_size).tolist(), (a.lengths % a.pool_size).tolist()
            for row, (pooled, open_count) in enumerate(zip(pooled_counts, open_counts)):
                # Only each row's own windows and open tokens are state; the rest of the storage is never read.
                torch.testing.assert_close(a.pooled_storage[row, :pooled], b.pooled_storage[row, :pooled],
                                           atol=1e-5, rtol=0)
                for name in ("open_index_keys", "open_gate_logits"):
                    torch.testing.assert_close(getattr(a, name)[row, :open_count], getattr(b, name)[row, :open_count],
                                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 13])  # inside and across windows of r = 4
def test_chunked_prefill_gives_the_logits_and_cache_of_one_pass(chunk_size):
    whole_model = tiny_model(prefill_chunk_length=None)
    chunked_model = tiny_model(prefill_chunk_length=chunk_size)
    input_ids = torch.randint(1, 97, (2, 43))
    mask = torch.ones(2, 43, dtype=torch.long)
    mask[1, :6] = 0
    whole_logits, whole_cache = prefill(whole_model, input_ids, mask)
    chunked_logits, chunked_cache = prefill(chunked_model, input_ids, mask)
    torch.testing.assert_close(chunked_logits[mask.bool()], whole_logits[mask.bool()], atol=1e-4, rtol=0)
    assert_same_cache(chunked_cache, whole_cache)
    with torch.no_grad():
        next_ids = torch.randint(1, 97, (2, 1))
        next_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        step = chunked_model(next_ids, attention_mask=next_mask, cache=chunked_cache).logits
        reference = whole_model(next_ids, attention_mask=next_mask, cache=whole_cache).logits
    torch.testing.assert_close(step, reference, atol=1e-4, rtol=0)


def test_generate_with_a_chunked_prefill_matches_one_pass():
    input_ids = torch.randint(1, 97, (1, 50))
    with torch.no_grad():
        chunked = tiny_model(prefill_chunk_length=7).generate(input_ids, max_new_tokens=6, do_sample=False)
        whole = tiny_model(prefill_chunk_length=None).generate(input_ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(chunked, whole)


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any operation allocates while active (views allocate nothing and are skipped)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.is_view:
            return result
        inputs = {arg.untyped_storage().data_ptr() for arg in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(arg, torch.Tensor)}
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            # In-place writes (into the cache's storage) return their input: nothing new was allocated.
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.numel())
        return result


def test_decode_step_allocations_do_not_grow_with_the_context(monkeypatch):
    monkeypatch.setattr(topk_reference, "WINDOW_CHUNK", 64)  # both contexts below span several window chunks
    model = tiny_model(index_topk=16)
    largest = {}
    for context in (700, 1500):  # capacities 768 and 1536: the step itself does not grow the storage
        _, cache = prefill(model, torch.randint(1, 97, (1, context)))
        with torch.no_grad(), LargestAllocation() as recorder:
            model(torch.randint(1, 97, (1, 1)), cache=cache)
        largest[context] = recorder.largest
    assert largest[700] == largest[1500], largest
    assert largest[1500] < 700  # nothing in the step is as large as even the smaller context
