"""What a stage compiles: the settings each compiled model takes, the graphs of a stage by name (built
from weights, or read back from a converted stage), and a layer's own compiled calls, for stages whose
layers run apart."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import openvino as ov

from cascadia.engine import graphs, llama_graphs
from cascadia.engine.graph_store import GraphStore
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import HeldStage, LayerWeights, StageReader
from cascadia.model.config import AttentionShape
from cascadia.model.formats import as_float, expert_slice

# (what, done, total): each graph compiled counts one
Progress = Callable[[str, int, int], None]


class UnsupportedSettings(ValueError):
    """Settings the device cannot compile (e.g. f16 fused experts on the CPU)."""


def compile_config(settings: EngineSettings, compute: str) -> dict[str, str]:
    config = {"INFERENCE_PRECISION_HINT": compute, "PERFORMANCE_HINT": "LATENCY"}
    if settings.device.upper().startswith(("CPU", "GPU")) or settings.activation_quant_group:
        # on the CPU and the iGPU always: both plugins quantise compressed matmuls' activations by
        # default (the CPU's in 2026.4, the GPU's on iGPUs without systolic arrays), which is not exact
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(settings.activation_quant_group)
    if settings.device.upper().startswith("CPU") and settings.paged_attention:
        # the plugin gives PagedAttention's pools this precision (u8 by default on this CPU)
        config["KEY_CACHE_PRECISION"] = config["VALUE_CACHE_PRECISION"] = settings.kv_precision
    if settings.threads:
        config["INFERENCE_NUM_THREADS"] = str(settings.threads)
    if settings.profile_ops:
        config["PERF_COUNT"] = "YES"
    return config


def conv_widths(attention: AttentionShape, hidden: int) -> tuple[int, int, int, int]:
    """Widths of a layer's short-convolution inputs k, v, o and m, as they lie side by side in its ring."""
    return attention.kv_width, attention.kv_width, hidden, hidden


def _power_of_two_scale(layer: LayerWeights) -> float:
    """Scale for the down projection so that f16 expert outputs stay far below f16's maximum.

    A bound on |output| per unit of input activation is the largest row L1-norm of the down
    weights; 2^-n brings it under 2^8, leaving room for large activations.
    """
    down = layer.experts.down
    # expert by expert: a bank of the real model's width in f32 would not fit in memory
    bound = max(float(np.abs(as_float(expert_slice(down, j))).sum(axis=-1).max()) for j in range(down.shape[0]))
    exponent = max(0, math.ceil(math.log2(max(bound, 1e-30))) - 8)
    return 2.0**-exponent


class CompiledLayer:
    """What a step needs to know of one layer, and its compiled models when it runs as calls of its own."""

    def __init__(self, shape, index: int) -> None:
        self.index = index
        self.attention = shape.layer_attention(index)
        # rotary positions (Llama) or log-scaled queries (Inkling's global layers) need each row's position
        self.needs_query_position = shape.family == "llama" or (
            self.attention.kind == "global" and shape.log_scaling_n_floor is not None
        )
        self.has_convs = shape.has_convs
        # what a step keeps of the layer, besides its output rows, when it runs in a joined stage
        self.joined_outputs = ("new_k", "new_v", *(("conv_in",) if shape.has_convs else ()))
        self.conv_splits = list(np.cumsum(conv_widths(self.attention, shape.hidden_size))[:-1])
        # Llama has no relative bias, so every cached key is read from the far blocks: no cached band
        self.has_cached_band = shape.family != "llama"
        self.attention_model: ov.CompiledModel | None = None
        self.expert_model: ov.CompiledModel | None = None
        self.attention_request: ov.InferRequest | None = None
        self.expert_request: ov.InferRequest | None = None
        self.post_request: ov.InferRequest | None = None

    def compile(
        self, core: ov.Core, source: StageReader | HeldStage, settings: EngineSettings, store: GraphStore
    ) -> None:
        """The layer's own models: attention with the experts, or (experts that run apart,
        `EngineSettings.split_expert_graph`) attention, experts and the post-expert residual as three."""
        split = settings.split_expert_graph
        residual_cfg = compile_config(settings, settings.residual_compute)
        i = self.index

        names = [f"layer{i}.attention", f"layer{i}.experts", f"layer{i}.post"] if split else [f"layer{i}"]
        # every graph of the layer first, then the reader's copy of its weights goes, then the plugin's
        model, *rest = [store.model(name, graph_builder(source, settings, name)) for name in names]
        source.release()
        self.attention_model = core.compile_model(model, settings.device, residual_cfg)
        self.attention_request = self.attention_model.create_infer_request()
        if not split:
            return
        experts, post_model = rest
        try:
            self.expert_model = core.compile_model(
                experts, settings.device, compile_config(settings, settings.expert_compute)
            )
        except RuntimeError as exc:
            raise UnsupportedSettings(
                f"layer {i}: the fused experts do not compile on {settings.device} with "
                f"expert_compute={settings.expert_compute} ({str(exc).strip().splitlines()[-1]}); "
                "f16 arithmetic is the iGPU's, use f32 or bf16 on the CPU"
            ) from exc
        self.expert_request = self.expert_model.create_infer_request()
        self.post_request = core.compile_model(post_model, settings.device, residual_cfg).create_infer_request()

    def run(
        self, inputs: dict[str, np.ndarray | ov.Tensor], hist_m: np.ndarray | None, conv_index: np.ndarray
    ) -> dict[str, np.ndarray]:
        assert self.attention_request is not None, "a layer of a joined stage runs in the stage's call"
        out = infer(self.attention_request, inputs)
        if self.expert_request is None:
            return out
        expert_out = infer(
            self.expert_request,
            {
                "mlp_input": out["mlp_input"],
                "expert_index": out["expert_index"],
                "expert_weight": out["expert_weight"],
            },
        )["expert_out"]
        assert self.post_request is not None
        post = {"expert_out": expert_out, "residual": out["residual"]}
        if self.has_convs:
            post.update({"conv_hist_m": hist_m, "conv_index": conv_index})
        out.update(infer(self.post_request, post))
        return out


def graph_builder(source: StageReader | HeldStage, settings: EngineSettings, name: str) -> Callable[[], ov.Model]:
    """How to build the stage graph `name` (one of `graph_store.stage_graph_names`) from `source`'s weights.

    A reader keeps the layer it read last, so a layer's three graphs (split experts) read it once.
    """
    shape = source.shape
    if name == "embed":

        def embed() -> ov.Model:
            weights, norm, _, _ = source.ends()
            return graphs.embed_graph(weights, norm, shape.rms_norm_eps, settings.head_weights)

        return embed
    if name == "head":

        def head() -> ov.Model:
            _, _, final_norm, weights = source.ends()
            return graphs.head_graph(shape, final_norm, weights, settings.head_weights, compute=settings.head_compute)

        return head
    layer, _, part = name.removeprefix("layer").partition(".")
    i = int(layer)
    if part == "":
        return lambda: _layer_graph(shape, source.layer(i), settings, settings.expert_weights)
    if part == "attention":
        return lambda: _layer_graph(shape, source.layer(i), settings, None)
    if part == "experts":

        def experts() -> ov.Model:
            weights = source.layer(i)
            scale = _power_of_two_scale(weights)
            return graphs.expert_graph(shape, weights, settings.expert_weights, scale, settings.ffn_form)

        return experts
    if part == "post":
        return lambda: graphs.post_graph(shape, source.layer(i), _power_of_two_scale(source.layer(i)))
    raise ValueError(f"no stage graph named '{name}'")


def _layer_graph(shape, weights: LayerWeights, settings: EngineSettings, expert_fmt) -> ov.Model:
    build = llama_graphs.layer_graph if shape.family == "llama" else graphs.attention_graph
    return build(
        shape,
        weights,
        settings.attention_weights,
        expert_fmt,
        kv_type=settings.kv_precision,
        ffn=settings.ffn_form,
    )


def infer(
    request: ov.InferRequest, inputs: dict[str, np.ndarray | ov.Tensor], outputs: list[str] | None = None
) -> dict[str, np.ndarray]:
    """Run `request` and copy out the named outputs (default: all of them)."""
    request.infer(inputs, share_inputs=True)
    names = outputs if outputs is not None else [out.get_any_name() for out in request.model_outputs]
    return {name: request.get_tensor(name).data.copy() for name in names}
