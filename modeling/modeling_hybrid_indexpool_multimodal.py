"""HybridIndexPool with images and video: a transformers vision tower in front of the HybridIndexPool text model, as
Qwen4-Exp (Qwen3.8-Flash-Next) and GLM-5.3-Flash put their own in front of their text models.

The vision tower (built from `vision_config` by `AutoModel`: Qwen4-Exp's or GLM-5.3-Flash's) gives merged patch
features that replace the image / video placeholder tokens. A text model with RoPE runs with three-stream multimodal
RoPE (time, height, width), whose positions come from the layout of the prompt (`get_rope_index`); the indexer's
windows follow the order of the real tokens, and a pooled window's key is rotated at the multimodal position of the
window's first token, as Qwen4-Exp rotates its blocks. After the prompt, each row decodes at its token count plus the
offset its images left (`rope_deltas`, kept in the cache). A text model without RoPE (GLM-5.3-Flash's) only counts
tokens, images included, as GLM does.
"""

import itertools

import torch
from torch import nn
from transformers import AutoModel
from transformers.processing_utils import Unpack
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple

from ..configuration.configuration_hybrid_indexpool import HybridIndexPoolMultimodalConfig
from .cache_hybrid_indexpool import HybridIndexPoolCache
from .generation import HybridIndexPoolGenerationMixin
from .inputs import HybridIndexPoolKwargs, check_inputs
from .layers import HybridIndexPoolLinear
from .losses import causal_lm_output, wants_mtp_logits
from .modeling_hybrid_indexpool import HybridIndexPoolModel, HybridIndexPoolPreTrainedModel
from .outputs import HybridIndexPoolCausalLMOutput, HybridIndexPoolModelOutput

TEXT, IMAGE, VIDEO = 0, 1, 2


def frame_grids(video_grid_thw: torch.LongTensor) -> torch.LongTensor:
    """`[videos, 3]` grids (frames, height, width) -> `[frames, 3]`, one `(1, height, width)` grid per frame."""
    per_frame = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    return torch.cat([torch.ones_like(per_frame[:, :1]), per_frame[:, 1:]], dim=1)


class HybridIndexPoolMultimodalPreTrainedModel(HybridIndexPoolPreTrainedModel):
    """Weight initialisation and plumbing of the multimodal models (the vision tower initialises as transformers'
    own)."""

    config_class = HybridIndexPoolMultimodalConfig
    config: HybridIndexPoolMultimodalConfig
    input_modalities = ("image", "video", "text")
    _no_split_modules = ["HybridIndexPoolDecoderLayer", "Qwen4ExpVisionBlock", "Glm5NextVisionBlock",
                         "Glm5NextVisionPatchMerger"]


class HybridIndexPoolMultimodalModel(HybridIndexPoolMultimodalPreTrainedModel):
    """The vision tower (`visual`, transformers' `Qwen4ExpVisionModel` or `Glm5NextVisionModel`) and the text model
    (`language_model`, a [`HybridIndexPoolModel`]); returns the text model's output."""

    def __init__(self, config: HybridIndexPoolMultimodalConfig):
        config.check_settings()
        super().__init__(config)
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = HybridIndexPoolModel(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.language_model.embed_tokens = value

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.LongTensor) -> torch.Tensor:
        """Merged patch features `[image tokens, hidden]` of all images (their placeholders' embeddings)."""
        pixel_values = pixel_values.to(self.visual.dtype)
        return self.visual(pixel_values, grid_thw=image_grid_thw, return_dict=True).pooler_output

    def get_video_features(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.LongTensor) -> torch.Tensor:
        """Merged patch features `[video tokens, hidden]` of all videos, frame after frame. In GLM-5.3-Flash's layout
        (`video_start_token_id` set) each frame goes through the vision tower alone, as GLM does."""
        if self.config.video_start_token_id is not None:
            video_grid_thw = frame_grids(video_grid_thw)
        return self.get_image_features(pixel_values_videos, video_grid_thw)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[batch, seq]`: 0 for text, 1 for image placeholders, 2 for video placeholders: `video_token_id`, or in
        GLM-5.3-Flash's layout (`video_start_token_id` set) the image placeholders between the video delimiters."""
        image = input_ids == self.config.image_token_id
        if self.config.video_start_token_id is None:
            video = input_ids == self.config.video_token_id
        else:
            starts = (input_ids == self.config.video_start_token_id).cumsum(-1)
            in_video = starts > (input_ids == self.config.video_end_token_id).cumsum(-1)
            image, video = image & ~in_video, image & in_video
        return IMAGE * image.long() + VIDEO * video.long()

    def get_rope_index(
        self,
        input_ids: torch.LongTensor,
        mm_token_type_ids: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE positions of a prompt: `[3, batch, seq]` (time, height, width) and each row's offset
        `[batch, 1]` from its token count to the next position (its `rope_deltas`). Reads the device.

        Text tokens advance all three streams by one. An image (or one video frame: videos are split into frames,
        which the prompt separates by timestamps) of merged grid `t x h x w` starts at the current position `p`:
        its tokens get time `p + t'`, height `p + h'` and width `p + w'`, and the next position is `p + max(h, w)`.
        Padding gets 0 and takes no position.
        """
        merge = self.config.vision_config.spatial_merge_size
        if mm_token_type_ids is None:
            mm_token_type_ids = self.token_types(input_ids)
        if video_grid_thw is not None:
            video_grid_thw = frame_grids(video_grid_thw)
        grids = {IMAGE: iter([] if image_grid_thw is None else image_grid_thw.tolist()),
                 VIDEO: iter([] if video_grid_thw is None else video_grid_thw.tolist())}
        batch_size, seq_len = input_ids.shape
        position_ids = torch.zeros(3, batch_size, seq_len, dtype=torch.long, device=input_ids.device)
        deltas = []
        for row in range(batch_size):
            real = (torch.ones(seq_len, dtype=torch.bool, device=input_ids.device) if attention_mask is None
                    else attention_mask[row].bool())
            types = mm_token_type_ids[row][real].tolist()
            pieces, current, start = [], 0, 0
            for kind, group in itertools.groupby(types):
                length = len(list(group))
                if kind == TEXT:
                    pieces.append(torch.arange(current, current + length).expand(3, -1))
                    current += length
                else:
                    grid = next(grids[kind], None)
                    if grid is None:
                        raise ValueError(f"Row {row} has more {'image' if kind == IMAGE else 'video'} placeholder "
                                         "groups than `image_grid_thw` / `video_grid_thw` describe.")
                    frames, height, width = grid[0], grid[1] // merge, grid[2] // merge
                    if frames * height * width != length:
                        raise ValueError(
                            f"Row {row}: a group of {length} {'image' if kind == IMAGE else 'video'} placeholder "
                            f"tokens for a grid {grid} of {frames * height * width} merged patches; the prompt and "
                            "the grids do not match (use the processor that made the pixel values)."
                        )
                    time, down, across = torch.meshgrid(torch.arange(frames), torch.arange(height),
                                                        torch.arange(width), indexing="ij")
                    pieces.append(torch.stack([time, down, across]).reshape(3, -1) + current)
                    current += max(height, width)
                start += length
            row_positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
            position_ids[:, row, real] = row_positions.to(input_ids.device)
            deltas.append((int(row_positions.max()) + 1 if row_positions.numel() else 0) - len(types))
        return position_ids, torch.tensor(deltas, device=input_ids.device)[:, None]

    @staticmethod
    def _merge_features(inputs_embeds, placeholders, features, name):
        """Put `features` in place of the `placeholders` (`[batch, seq]` bool); their counts must agree."""
        count = int(placeholders.sum())
        if count != features.shape[0]:
            raise ValueError(f"The prompt has {count} {name} placeholder tokens but the {name}s give "
                             f"{features.shape[0]} features; use the processor that made the pixel values.")
        return inputs_embeds.masked_scatter(placeholders[..., None], features.to(inputs_embeds.dtype))

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[HybridIndexPoolKwargs],
    ) -> HybridIndexPoolModelOutput:
        """Run the text model on the prompt with the vision features in place of the placeholder tokens (the text
        model's outputs, recorded by its own output capture, as transformers' Qwen3-VL does).

        Args beyond [`HybridIndexPoolModel.forward`]'s:
            pixel_values, pixel_values_videos: the processor's patches of the images / videos.
            image_grid_thw, video_grid_thw: `[count, 3]` patch grids (time, height, width) of each image / video.
            mm_token_type_ids: `[batch, seq]` 0 text, 1 image, 2 video (derived from the placeholder tokens when
                not given).
        """
        has_vision = pixel_values is not None or pixel_values_videos is not None
        if has_vision and input_ids is None:
            raise ValueError("Images and videos need `input_ids` (their placeholder tokens mark where they go).")
        if inputs_embeds is None and input_ids is not None:
            check_inputs(self.language_model.config, input_ids, None)
            inputs_embeds = self.get_input_embeddings()(input_ids)
        placeholder_types = self.token_types(input_ids) if has_vision else None
        if pixel_values is not None:
            if image_grid_thw is None:
                raise ValueError("`pixel_values` need `image_grid_thw`, each image's patch grid (from the processor).")
            inputs_embeds = self._merge_features(inputs_embeds, placeholder_types == IMAGE,
                                                 self.get_image_features(pixel_values, image_grid_thw), "image")
        if pixel_values_videos is not None:
            if video_grid_thw is None:
                raise ValueError("`pixel_values_videos` need `video_grid_thw` (from the processor).")
            inputs_embeds = self._merge_features(inputs_embeds, placeholder_types == VIDEO,
                                                 self.get_video_features(pixel_values_videos, video_grid_thw), "video")

        use_cache = use_cache if use_cache is not None else self.config.text_config.use_cache
        if use_cache and cache is None:
            cache = HybridIndexPoolCache(self.config.text_config)
        grids = image_grid_thw is not None or video_grid_thw is not None
        # The prompt (the cache's first input) lays out the positions; a decode step continues from its offsets.
        prompt = cache is None or cache.seen_tokens is None
        if position_ids is None and grids and input_ids is not None and prompt and self.config.multimodal_rope:
            seq_len = input_ids.shape[1]
            mask = None if attention_mask is None else attention_mask[:, -seq_len:]
            position_ids, rope_deltas = self.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw,
                                                            video_grid_thw, mask)
            if cache is not None:
                cache.rope_deltas = rope_deltas
        elif has_vision and not prompt:
            raise ValueError(
                "Images and videos go in a cache's first input (the prompt): their positions are laid out from it. "
                "Start a new cache for a new prompt with images."
            )
        kwargs.setdefault("ple_input_ids", input_ids)
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=use_cache, **kwargs,
        )


class HybridIndexPoolForConditionalGeneration(HybridIndexPoolMultimodalPreTrainedModel,
                                              HybridIndexPoolGenerationMixin):
    """The multimodal model with a language-modelling head: image / video + text in, text out. `generate()` takes
    `pixel_values` / `pixel_values_videos` with their grids and uses a [`HybridIndexPoolCache`]."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}

    def __init__(self, config: HybridIndexPoolMultimodalConfig):
        super().__init__(config)
        self.model = HybridIndexPoolMultimodalModel(config)
        self.vocab_size = config.text_config.vocab_size
        self.lm_head = HybridIndexPoolLinear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HybridIndexPoolCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[HybridIndexPoolKwargs],
    ) -> HybridIndexPoolCausalLMOutput:
        """Next-token logits (of the last `logits_to_keep` positions when non-zero) and, given `labels`, the loss
        (with the text model's load-balancing loss under `output_router_logits` and the MTP logits and loss under
        `output_mtp_logits`, as in the text-only model)."""
        text_config = self.config.text_config
        mtp_logits = wants_mtp_logits(text_config, kwargs.pop("output_mtp_logits", None), labels)
        kwargs["output_mtp_hidden_states"] = mtp_logits or kwargs.get("output_mtp_hidden_states", False)
        if kwargs.get("output_router_logits") is None:  # the config's default, as transformers' MoE heads take it
            kwargs["output_router_logits"] = text_config.output_router_logits
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids,
            use_cache=use_cache, **kwargs,
        )
        return causal_lm_output(self, outputs, labels, logits_to_keep, attention_mask, mtp_logits, **kwargs)


__all__ = [
    "HybridIndexPoolMultimodalPreTrainedModel",
    "HybridIndexPoolMultimodalModel",
    "HybridIndexPoolForConditionalGeneration",
]
