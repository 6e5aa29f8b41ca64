"""Engine settings: device, weight format per tensor class, compute precision per graph."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from cascadia import defaults
from cascadia.engine.weights import WEIGHT_FORMATS, WeightFormat
from cascadia.model.checkpoint import StoredForms

Compute = Literal["f32", "bf16", "f16"]
KvPrecision = Literal["f32", "f16", "u8"]
DenseFfn = Literal["auto", "experts", "matmul"]
DENSE_FFNS: tuple[DenseFfn, ...] = ("auto", "experts", "matmul")
ExpertKernel = Literal["auto", "fused", "grouped", "vnni"]
EXPERT_KERNELS: tuple[ExpertKernel, ...] = ("auto", "fused", "grouped", "vnni")
BankForm = Literal["fused", "grouped", "vnni"]
# the input quantisation group of the project's int8 expert kernel (`cascadia.engine.cpu_kernels`)
VNNI_GROUP = 32
LlamaAttention = Literal["auto", "paged", "blocks"]
LLAMA_ATTENTIONS: tuple[LlamaAttention, ...] = ("auto", "paged", "blocks")
KV_PRECISIONS: tuple[KvPrecision, ...] = ("f32", "f16", "u8")
COMPUTE_PRECISIONS: tuple[Compute, ...] = ("f32", "bf16", "f16")
HeadCompute = Literal["f32", "bf16"]
HEAD_COMPUTES: tuple[HeadCompute, ...] = ("f32", "bf16")
PRECISION_PRESETS = defaults.PRECISIONS

DEFAULT_CONTEXT = 1024
MAX_CONTEXT = 512 * 1024


@dataclass(frozen=True)
class FfnForm:
    """How a layer's FFN is emitted into its graph.

    `dense`: a dense bank as all-active expert slices ("experts") or plain matmuls ("matmul").
    `experts`: an expert bank in the vectorised form the plugins fuse into their MoE kernels
    ("fused"), or its (row, expert) pairs sorted by expert and each expert's rows run as one plain
    matmul ("grouped"), or on the CPU the project's int8 kernel ("vnni", int8-stored banks with int8
    inputs; others run grouped).
    `compressed_experts`: the form of a bank whose weights are stored compressed, whether by the
    expert format or as read from the file (a GGUF's blocks); `experts` is then the f32 banks' form.
    `compute`: the arithmetic of the banks, dense FFNs and shared experts. "bf16" runs them as
    bf16-typed ops inside the residual stream's f32 graph (inputs and weights converted, outputs back
    to f32), which the CPU's bf16 matmul kernels take as they are.
    """

    dense: Literal["experts", "matmul"] = "experts"
    experts: BankForm = "fused"
    compressed_experts: BankForm = "fused"
    compute: Literal["f32", "bf16"] = "f32"


FUSED_FFN = FfnForm()  # one fused expert path for sparse and dense layers, the iGPU's form


@dataclass(frozen=True)
class EngineSettings:
    device: str = "CPU"
    expert_weights: WeightFormat = "f32"
    attention_weights: WeightFormat = "f32"
    head_weights: WeightFormat = "f32"
    # the experts' graph; the residual stream (norms, attention, router, convs) has its own
    expert_compute: Compute = "f32"
    residual_compute: Compute = "f32"
    # the arithmetic of a head stored in f32 ("bf16": typed inside its f32 graph, as bf16 experts are;
    # the norm and the logits stay f32). At 32 rows of the mini preset the f32 head cost as much as
    # every attention projection of the stage together
    head_compute: HeadCompute = "f32"
    context: int = DEFAULT_CONTEXT  # global-layer positions per stream
    rewind_slack: int = 32  # positions a stream can step back on sliding layers and convs
    threads: int = 0  # 0: the plugin's default
    # the plugins can quantise activations to int8 in groups of this many values for compressed-weight
    # matmuls, which then multiply in int8 (VNNI, AMX); 0 keeps them in the compute precision (exact to
    # the dequantised weights)
    activation_quant_group: int = 0
    # what every row runs (dense FFNs, and sparse layers' shared experts): "experts" runs it as
    # all-active slices through the expert kernel (one path for sparse and dense layers), "matmul" as
    # plain matmuls over the joined slices beside the routed bank; "auto" picks per device
    dense_ffn: DenseFfn = "auto"
    # expert banks: "fused" emits the form OpenVINO fuses into its MoE kernel, "grouped" one matmul
    # per expert over the rows that chose it, "vnni" the project's int8 CPU kernel (int8 banks with
    # inputs quantised in groups of 32); "auto" picks per device and precision
    expert_kernel: ExpertKernel = "auto"
    # keys and values as the streams keep them; f16 halves KV memory for long contexts, u8 (a scale
    # and an offset per row and head) takes a little over a quarter
    kv_precision: KvPrecision = "f32"
    # Llama-family stages: "paged" attends through OpenVINO's PagedAttention op over block pools the
    # plugin writes in place; "blocks" through our own graph over the cache's blocks; "auto" per device
    llama_attention: LlamaAttention = "auto"
    # compiled graphs read their weights through a file mapping (`cascadia.engine.mapped`), which the
    # system can drop under pressure, instead of holding them in anonymous memory
    map_weights: bool = True
    # streams the ring pools are sized for: they grow by doublings up to this count, and past it only
    # when more streams open (0: by doublings alone, so 88 streams hold 128 slots)
    planned_streams: int = 0
    # Inkling's layers of a stage as one compiled model, one call per step, unless the experts need a
    # compiled model of their own (`split_expert_graph`); else one model per layer (three with split experts)
    joined_layers: bool = True
    # the plugin times every op of every call (PERF_COUNT), read back by `StageEngine.op_times`; the
    # timing itself costs a little, so only benchmarks that break a step down ask for it
    profile_ops: bool = False

    def __post_init__(self) -> None:
        for name in ("expert_weights", "attention_weights", "head_weights"):
            if getattr(self, name) not in WEIGHT_FORMATS:
                raise ValueError(f"{name} '{getattr(self, name)}' is not one of {', '.join(WEIGHT_FORMATS)}")
        for name in ("expert_compute", "residual_compute"):
            if getattr(self, name) not in COMPUTE_PRECISIONS:
                raise ValueError(f"{name} '{getattr(self, name)}' is not one of {', '.join(COMPUTE_PRECISIONS)}")
        if self.head_compute not in HEAD_COMPUTES:
            raise ValueError(f"head_compute '{self.head_compute}' is not one of {', '.join(HEAD_COMPUTES)}")
        if not 1 <= self.context <= MAX_CONTEXT:
            raise ValueError(f"context {self.context} must be between 1 and {MAX_CONTEXT} positions")
        if self.kv_precision not in KV_PRECISIONS:
            raise ValueError(f"kv_precision '{self.kv_precision}' is not one of {', '.join(KV_PRECISIONS)}")
        if self.dense_ffn not in DENSE_FFNS:
            raise ValueError(f"dense_ffn '{self.dense_ffn}' is not one of {', '.join(DENSE_FFNS)}")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ValueError(f"expert_kernel '{self.expert_kernel}' is not one of {', '.join(EXPERT_KERNELS)}")
        if self.expert_kernel == "vnni" and self.activation_quant_group != VNNI_GROUP:
            # the kernel always quantises its inputs: asked for otherwise, it would do so unasked
            raise ValueError(
                f"expert_kernel 'vnni' quantises the banks' inputs in groups of {VNNI_GROUP}: it needs "
                f"activation_quant_group {VNNI_GROUP} (the w8a8 preset), got {self.activation_quant_group}"
            )
        if self.llama_attention not in LLAMA_ATTENTIONS:
            raise ValueError(f"llama_attention '{self.llama_attention}' is not one of {', '.join(LLAMA_ATTENTIONS)}")
        if self.llama_attention == "paged" and self.kv_precision == "u8":
            raise ValueError("paged attention keeps keys and values in f32 or f16; u8 needs llama_attention 'blocks'")
        if self.rewind_slack < 0:
            raise ValueError(f"rewind_slack must be >= 0, got {self.rewind_slack}")
        if self.activation_quant_group < 0:
            raise ValueError(f"activation_quant_group must be >= 0, got {self.activation_quant_group}")
        if self.planned_streams < 0:
            raise ValueError(f"planned_streams must be >= 0, got {self.planned_streams}")

    @property
    def dense_ffn_path(self) -> Literal["experts", "matmul"]:
        """The form this device runs dense FFNs and shared experts in.

        The iGPU's fused expert kernel ran the slices faster than its plain matmuls; the CPU's
        GatherMatmul is built for sparse selection and runs every slice of every row as its own gemv
        (3.1x the plain matmuls at 8 rows here, docs/bench/history/benchmarks-log.md "Fused expert path"). A sparse
        layer's shared experts are such slices too: on the CPU they run as two plain matmuls (their
        stacked gate and up, their joined down projection, each row's routing weights between them),
        which read the weights at the plain matmuls' rate even at one row.
        """
        if self.dense_ffn != "auto":
            return self.dense_ffn
        return "experts" if self.device.upper().startswith("GPU") else "matmul"

    @property
    def expert_kernel_path(self) -> BankForm:
        """The expert bank form this device runs for banks as these settings store them.

        The CPU plugin's fused kernel (GatherMatmul) runs a matrix-vector product per (row, expert)
        pair on a CPU without AMX, so an expert's weights are read again for every row that chose it.
        With f32 weights, grouped matmuls read each expert once per step and win from about eight
        rows on (1.23x the fused kernel at 32 streams of the mini preset, 0.88x at one). The iGPU
        keeps its fused MoE kernel. Compressed weights take `compressed_kernel_path`.

        Experts computed in bf16 keep the fused kernel too: on an AVX-512 BF16 CPU it ran 1.3x the
        grouped bf16 matmuls at one stream of the mini preset and tied them at 32 (0.98x), though
        grouped prefilled 1.5x as fast (docs/bench/history/benchmarks-log.md "bf16 experts inside the stage's graph").
        """
        if self.expert_weights != "f32":
            return self.compressed_kernel_path
        if self.expert_kernel != "auto":
            return self.expert_kernel
        cpu = self.device.upper().startswith("CPU")
        return "grouped" if cpu and self.expert_compute == "f32" else "fused"

    @property
    def compressed_kernel_path(self) -> BankForm:
        """The form of banks whose weights are compressed, by these settings or as read (a GGUF's blocks).

        On the CPU the fused kernel decompresses faster than the plain compressed matmuls and stays
        ahead to about 32 rows (docs/bench/history/benchmarks-log.md "Grouped experts"). With int8 activations
        (`activation_quant_group`) the plain compressed matmuls multiply in int8, and grouped banks ran
        1.34x the fused kernel at 32 streams of the mini preset (0.75x at one stream;
        docs/bench/history/benchmarks-log.md "int8 activations"). The project's own int8 kernel reads each chosen expert
        once a call without the grouped banks' per-expert nodes, so int8 banks with inputs in its
        groups run on it where the CPU has AVX-512 VNNI (the graph falls back to grouped elsewhere,
        `cascadia.engine.graphs`), and other compressed banks with int8 inputs run grouped. The iGPU
        keeps its fused kernel.
        """
        if self.expert_kernel != "auto":
            return self.expert_kernel
        if not self.device.upper().startswith("CPU") or not self.activation_quant_group:
            return "fused"
        return "vnni" if self.activation_quant_group == VNNI_GROUP else "grouped"

    @property
    def ffn_form(self) -> FfnForm:
        compute = "bf16" if self.typed_experts else "f32"
        return FfnForm(self.dense_ffn_path, self.expert_kernel_path, self.compressed_kernel_path, compute)

    @property
    def stored_forms(self) -> StoredForms:
        """The formats the graphs hold weights in, so that a reader quantises them as it reads."""
        return StoredForms(
            self.expert_weights, self.attention_weights, self.head_weights, self.dense_ffn_path == "matmul"
        )

    @property
    def paged_attention(self) -> bool:
        """Whether Llama-family stages attend through PagedAttention.

        On the CPU the op's kernel (blocks of 32 positions, [blocks, heads, 32, D] pools) replaces about
        forty nodes per layer and the per-step cache inputs and outputs. The iGPU plugin's op wants
        another pool layout and block size, not built here, so "auto" keeps our block graph there,
        and u8 keys and values (our row format, not the plugin's) keep it too.
        """
        if self.llama_attention != "auto":
            return self.llama_attention == "paged"
        return self.device.upper().startswith("CPU") and self.kv_precision != "u8"

    @property
    def typed_experts(self) -> bool:
        """bf16 experts beside an f32 residual stream run as bf16-typed ops in the stream's own graph.

        bf16 keeps f32's exponent range, so no rescaling guards them, and the CPU's bf16 matmuls take
        bf16 inputs at an f32 hint: one compiled model (one call per stage) instead of three per layer.
        """
        return self.expert_compute == "bf16" and self.residual_compute == "f32"

    @property
    def split_expert_graph(self) -> bool:
        """Experts at another precision than the residual stream need a compiled model of their own
        (f16, the iGPU's, with power-of-two rescaling), unless they run typed in its graph."""
        return self.expert_compute != self.residual_compute and not self.typed_experts


def preset(name: str, device: str = "CPU", **overrides: object) -> EngineSettings:
    """The named precision modes of `cascadia generate --precision`.

    The iGPU computes experts in f16; the CPU keeps f32 arithmetic for the quantised modes, since its
    compressed-weight kernels decompress to f32 and its f16 hint does not compile every fused graph.

    "w8a8" is int8 experts and head whose inputs the plugin quantises to int8 in groups of 32 at each
    call, so their matmuls multiply in int8: the fastest mode at many streams on a CPU with VNNI or
    AMX, and within 1% of the dequantised weights per layer (0.42% on the mini preset, logits 0.57%).
    The attention stays f32: quantising its inputs too put a layer of the mini preset 5.5% off.

    "w4a8" is int4 experts with int8 head whose inputs are quantised the same way, and attention
    weights the plugins leave unquantised: a 975B layer's attention, its inputs quantised, moved the
    router's input enough to change the chosen experts of one row in ten (6.4% off). On the iGPU they
    are f16 (exact for bf16 checkpoints); on the CPU f32, since its plugin holds f16 weights as an f32
    copy beside the f16 ones (a real-width layer with 4 experts held 1,222 MiB compiled with f16
    attention, 766 MiB with f32, 310 MiB with int8). Its
    banks keep the fused kernel, which with int8 inputs multiplies in int8 (the project's int8 kernel
    takes int8 banks only): 1.2-1.3x its f32-input steps at 1 and 8 rows of a 975B layer.
    """
    if name not in PRECISION_PRESETS:
        raise ValueError(f"precision '{name}' is not one of {', '.join(PRECISION_PRESETS)}")
    gpu = device.upper().startswith("GPU")
    low: Compute = "f16" if gpu else "f32"

    def stored(experts: WeightFormat, attention: WeightFormat, head: WeightFormat, **more: object) -> EngineSettings:
        return EngineSettings(
            device=device,
            expert_weights=experts,
            attention_weights=attention,
            head_weights=head,
            expert_compute=low,
            **more,  # type: ignore[arg-type]
        )

    table: dict[str, EngineSettings] = {
        "f32": EngineSettings(device=device),
        "bf16": EngineSettings(device=device, expert_compute="bf16", head_compute="bf16"),
        "f16": stored("f16", "f16", "f16"),
        "int8": stored("int8", "int8", "int8"),
        "int4": stored("int4", "int8", "int8"),
        "w8a8": stored("int8", "f32", "int8", activation_quant_group=32),
        "w4a8": stored("int4", "f16" if gpu else "f32", "int8", activation_quant_group=32, expert_kernel="fused"),
    }
    return replace(table[name], **overrides)  # type: ignore[arg-type]
