"""`cascadia bench peer`: our engine and fleet against OpenVINO GenAI on the same GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Our f32 mode's settings, spelled for GenAI: f32 arithmetic, f32 KV cache, no int8 activations
GENAI_F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def genai_pipeline(model: Path, device: str = "CPU", **extra: Any):
    """GenAI's LLMPipeline on a GGUF file with the same precision settings as our f32 mode."""
    import openvino_genai

    return openvino_genai.LLMPipeline(str(model), device, **GENAI_F32, **extra)
