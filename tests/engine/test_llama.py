"""Llama-family models on the engine: a tiny random Llama against transformers, and the real SmolLM2-135M
GGUF against OpenVINO GenAI's LLMPipeline on the same file, in one process and across shard processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.engine.weights import dequantize, stored_node
from cascadia.gateway.text import TextCodec
from cascadia.model.gguf_file import GgufError, GgufFile, q4_1_blocks, q8_0_blocks
from cascadia.model.loader import ModelNotFound, load_shape, load_stage, resolve
from cascadia.sampling_params import SamplingParams

SMOLLM = "smollm2-135m"
PROMPTS = {
    "prose": "The capital of France is",
    "story": "Once upon a time, in a small village by the sea, there lived",
    "code": "def fibonacci(n):\n    ",
    "list": "Here are three tips for writing clear emails:\n1.",
}


# PagedAttention (the CPU's default) and our own block graph (the iGPU's), both against the oracle
ATTENTIONS = pytest.mark.parametrize("attention", ["paged", "blocks"])


# -- block formats (pure) ---------------------------------------------------------------------------


def test_q4_1_blocks_follow_the_zero_point_rule():
    rng = np.random.default_rng(0)
    rows, cols = 3, 64
    scale = rng.uniform(0.01, 0.2, size=(rows, cols // 32)).astype(np.float16)
    # a block that spans zero has its minimum within 15 steps below it
    minimum = (-rng.uniform(0.0, 15.0, size=(rows, cols // 32)) * scale).astype(np.float16)
    q = rng.integers(0, 16, size=(rows, cols // 32, 32)).astype(np.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8), packed], axis=-1)
    blocks = q4_1_blocks(raw.reshape(rows, -1), rows, cols)
    assert blocks.fmt == "u4" and blocks.shape == (rows, cols)
    np.testing.assert_array_equal(blocks.values, q)
    zero = np.floor(-minimum.astype(np.float32) / scale.astype(np.float32) + 0.5)
    np.testing.assert_array_equal(blocks.zero_point[..., 0], zero.astype(np.uint8))
    # the served weight is close to the file's d * q + m: within half a step of each block
    exact = (scale[..., None].astype(np.float32) * q + minimum[..., None].astype(np.float32)).reshape(rows, cols)
    step = np.repeat(scale.astype(np.float32), 32, axis=1)
    assert np.all(np.abs(dequantize(blocks) - exact) <= 0.5 * step + 1e-3)


def test_q8_0_blocks_are_exact():
    rng = np.random.default_rng(1)
    rows, cols = 2, 96
    scale = rng.uniform(0.001, 0.05, size=(rows, cols // 32)).astype(np.float16)
    q = rng.integers(-127, 128, size=(rows, cols // 32, 32)).astype(np.int8)
    raw = np.concatenate([scale[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    blocks = q8_0_blocks(raw.reshape(rows, -1), rows, cols)
    expected = (q.astype(np.float32) * scale[..., None].astype(np.float32)).reshape(rows, cols)  # as ggml computes
    np.testing.assert_array_equal(dequantize(blocks), expected)


@pytest.mark.parametrize("reader", [q4_1_blocks, q8_0_blocks])
def test_block_constants_compute_what_dequantize_says(reader):
    import openvino as ov
    import openvino.opset16 as ops

    rng = np.random.default_rng(2)
    rows, cols = 4, 64
    block_bytes = 20 if reader is q4_1_blocks else 34
    raw = rng.integers(0, 256, size=(rows, cols // 32, block_bytes)).astype(np.uint8)
    raw[..., 0:2] = np.array([0.05], np.float16).view(np.uint8)  # finite scales
    if reader is q4_1_blocks:
        raw[..., 2:4] = np.array([-0.3], np.float16).view(np.uint8)
    blocks = reader(raw.reshape(rows, -1), rows, cols)
    model = ov.Model([ops.result(stored_node(blocks, "w"))], [], "w")
    request = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    request.infer()
    np.testing.assert_array_equal(request.get_output_tensor(0).data, dequantize(blocks))


# -- files and names --------------------------------------------------------------------------------


def test_bad_gguf_files_fail_clearly(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(resolve(SMOLLM).read_bytes()[:4096])
    with pytest.raises(GgufError, match="cut.gguf: not a readable GGUF file"):
        GgufFile(truncated)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello, this is not a model")
    with pytest.raises(GgufError, match="bad magic"):
        GgufFile(not_gguf)
    with pytest.raises(ModelNotFound, match="no such checkpoint directory, .gguf file or packaged model"):
        resolve(tmp_path / "missing.gguf")


def test_packaged_model_resolves_to_its_gguf():
    path = resolve(SMOLLM)
    assert path.suffix == ".gguf" and path.is_file()
    shape = load_shape(path)
    assert (shape.family, shape.num_layers, shape.hidden_size, shape.vocab_size) == ("llama", 30, 576, 49152)
    assert shape.tie_word_embeddings and shape.rope_theta == 100000.0


# -- a tiny random Llama against transformers --------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_llama(request, tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=request.param,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy choices are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    out = tmp_path_factory.mktemp("llama") / ("tied" if request.param else "untied")
    model.save_pretrained(out)
    return out


def _oracle(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@ATTENTIONS
def test_tiny_llama_matches_transformers_layer_by_layer(tiny_llama, attention):
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention=attention))
    ids = np.random.default_rng(4).integers(3, 300, size=40)
    trace: list[np.ndarray] = []
    engine.open("s")
    logits = engine.step([Segment("s", 0, len(ids))], ids, trace=trace).logits
    with torch.no_grad():
        ref = _oracle(tiny_llama)(torch.tensor(ids[None]), output_hidden_states=True)
    for layer, (ours, theirs) in enumerate(zip(trace, ref.hidden_states[1:], strict=True)):
        theirs = theirs[0].numpy()
        if layer == shape.num_layers - 1:
            continue  # transformers' last hidden state is after the final norm
        rel = np.sqrt(np.mean((ours - theirs) ** 2)) / np.sqrt(np.mean(theirs**2))
        assert rel <= 1e-4, f"layer {layer}: relative rms {rel:.2e}"
    ref_logits = ref.logits[0].numpy()
    rel = np.sqrt(np.mean((logits - ref_logits) ** 2)) / np.sqrt(np.mean(ref_logits**2))
    assert rel <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref_logits.argmax(-1))


@ATTENTIONS
def test_tiny_llama_greedy_ids_match_transformers(tiny_llama, attention):
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention=attention))
    prompt = [5, 17, 250, 3, 99, 42]
    ours = generate(engine, prompt, SamplingParams(max_tokens=40), prefill_window=4).token_ids
    with torch.no_grad():
        theirs = _oracle(tiny_llama).generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours == theirs[0, len(prompt) :].tolist()


@ATTENTIONS
def test_tiny_llama_streams_batched_equal_streams_alone(tiny_llama, attention):
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention=attention))
    rng = np.random.default_rng(5)
    prompts = {name: rng.integers(3, 300, size=n) for name, n in (("a", 9), ("b", 3), ("c", 14))}
    alone = {}
    for name, ids in prompts.items():
        engine.open(name)
        alone[name] = engine.step([Segment(name, 0, len(ids))], ids).logits
        engine.close(name)
    # together, "c" split into a window and a later batch with the others' decode-sized pieces
    for name in prompts:
        engine.open(name)
    first = engine.step([Segment("c", 0, 10), Segment("a", 0, 9)], np.concatenate([prompts["c"][:10], prompts["a"]]))
    second = engine.step([Segment("b", 0, 3), Segment("c", 10, 4)], np.concatenate([prompts["b"], prompts["c"][10:]]))
    np.testing.assert_allclose(first.logits[10:], alone["a"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(second.logits[:3], alone["b"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([first.logits[:10], second.logits[3:]]), alone["c"], rtol=1e-4, atol=1e-4)


@ATTENTIONS
def test_tiny_llama_copy_of_a_streams_first_positions_goes_on_as_the_stream(tiny_llama, attention):
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention=attention))
    ids = np.random.default_rng(6).integers(3, 300, size=40)
    engine.open("src")
    whole = engine.step([Segment("src", 0, len(ids))], ids).logits
    engine.copy("src", "copy", 33)  # into the middle of a page
    rest = engine.step([Segment("copy", 33, 7)], ids[33:]).logits
    np.testing.assert_allclose(rest, whole[33:], rtol=1e-4, atol=1e-4)
    engine.close("src")
    engine.close("copy")


@ATTENTIONS
def test_tiny_llama_streams_are_copied_and_taken_over_further_back_than_the_rewind_slack(tiny_llama, tiny, attention):
    """A Llama stage holds every row (no ring drops any), so a kept stream serves a later prompt from any
    position: a copy and a take-over 50 positions back go on exactly as a fresh stream would."""
    shape = load_shape(tiny_llama)
    settings = EngineSettings(llama_attention=attention, rewind_slack=8)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), settings)
    assert not engine.rings and engine.reach == settings.context
    ids = np.random.default_rng(7).integers(3, 300, size=60)
    other = np.concatenate([ids[:10], np.random.default_rng(8).integers(3, 300, size=12)])
    engine.open("fresh")
    expected = engine.step([Segment("fresh", 0, len(other))], other).logits[10:]
    engine.close("fresh")
    engine.open("src")
    engine.step([Segment("src", 0, len(ids))], ids)
    engine.copy("src", "copy", 10)
    engine.adopt("src", "taken", 10)
    for stream in ("copy", "taken"):
        logits = engine.step([Segment(stream, 10, 12)], other[10:]).logits
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    engine.rewind("taken", 16)  # speculation's rewinds count from where it was stepped back to
    with pytest.raises(ValueError, match="rewind slack"):
        engine.rewind("taken", 12)
    engine.close("copy")
    engine.close("taken")
    inkling = StageEngine(load_stage(tiny, 0, 2), settings)  # sliding layers and convs keep rings
    assert inkling.rings and inkling.reach == 8


def test_a_llama_fleet_copies_and_takes_over_finished_streams_however_far_they_went_on(tiny_llama, tmp_path):
    """On Llama stages a finished stream serves later prompts from any position: another user's question
    after the same system prompt copies it where they part, and its own next turn takes it over, though
    each answer went on past the rewind slack; the ids are the single-process ones. Told where the system
    prompt ends, the first user leaves no copy there: its finished stream serves that."""
    import asyncio

    from cascadia.router.local import LocalFleet
    from cascadia.router.pipeline import PipelineDriver
    from cascadia.router.scheduler import Request, SchedulerConfig

    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings())
    rng = np.random.default_rng(9)
    system, first, second = (rng.integers(3, 300, size=n).tolist() for n in (40, 6, 7))
    params = SamplingParams(max_tokens=48)  # past the rewind slack (32)
    answer = generate(engine, system + first, params).token_ids
    requests = [
        Request("u1", tuple(system + first), params, shared_prefix=len(system)),
        Request("u2", tuple(system + second), params, shared_prefix=len(system)),
        Request("u1-next", tuple(system + first + answer[:-1] + [5, 6]), params),
    ]
    fleet = LocalFleet(tiny_llama, 2)
    fleet.start(tmp_path)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2))
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            done = [await driver.generate(r) for r in requests]
            return done, driver.scheduler.rewind_slack, driver.scheduler.shared_prefixes
        finally:
            await driver.stop()

    try:
        done, reach, shared_prefixes = asyncio.run(go())
    finally:
        fleet.stop()
    assert reach == EngineSettings().context  # every row is held: the whole context
    assert [p.tokens for p in done] == [generate(engine, r.prompt, r.params).token_ids for r in requests]
    assert done[0].tokens == answer
    cached = [p.events.get_nowait()[0].cached for p in done]
    assert cached == [0, 40, len(system + first + answer) - 1]
    assert shared_prefixes == 0


# -- SmolLM2-135M (real weights) against OpenVINO GenAI -------------------------------------------


@pytest.fixture(scope="module")
def smollm_engine() -> StageEngine:
    path = resolve(SMOLLM)
    return StageEngine(load_stage(path, 0, load_shape(path).num_layers), EngineSettings())


@pytest.fixture(scope="module")
def genai():
    genai = pytest.importorskip("openvino_genai")
    from cascadia.bench.peer import genai_pipeline

    return genai, genai_pipeline(resolve(SMOLLM))


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model(resolve(SMOLLM))


def _genai_greedy(genai, ids: list[int], n: int) -> list[int]:
    import openvino as ov

    module, pipe = genai
    config = module.GenerationConfig()
    config.max_new_tokens, config.do_sample, config.ignore_eos = n, False, True
    result = pipe.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
    return [int(t) for t in result.tokens[0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROMPTS))
def test_smollm_greedy_ids_equal_genai(name, smollm_engine, genai, codec):
    ids = codec.encode(PROMPTS[name])
    ours = generate(smollm_engine, ids, SamplingParams(max_tokens=40)).token_ids
    assert ours == _genai_greedy(genai, ids, 40)


@pytest.mark.slow
def test_smollm_chat_prompt_ids_equal_genai(smollm_engine, genai, codec):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    module, pipe = genai
    history = module.ChatHistory(messages) if hasattr(module, "ChatHistory") else messages
    text = pipe.get_tokenizer().apply_chat_template(history, add_generation_prompt=True)
    theirs = [int(t) for t in pipe.get_tokenizer().encode(text, add_special_tokens=False).input_ids.data[0]]
    ids = codec.encode_chat(messages)
    assert ids == theirs
    for sample in [*PROMPTS.values(), "Numbers 12345 and 3.14159, émigré café ☕ 日本語", "  two  spaces\t\ttabs\n\n"]:
        genai_ids = [int(t) for t in pipe.get_tokenizer().encode(sample, add_special_tokens=False).input_ids.data[0]]
        assert codec.encode(sample) == genai_ids, sample
    answer = generate(smollm_engine, ids, SamplingParams(max_tokens=8, stop_ids=codec.stop_token_ids)).token_ids
    assert "Paris" in codec.decode(answer)


@pytest.mark.slow
def test_smollm_knows_the_capital_of_france(smollm_engine, codec):
    ids = codec.encode("The capital of France is")
    out = generate(smollm_engine, ids, SamplingParams(max_tokens=4)).token_ids
    assert codec.decode(out).startswith(" Paris")


@pytest.mark.slow
def test_smollm_with_u8_kv_keeps_the_f32_kv_greedy_continuation(smollm_engine, codec):
    """On real weights the u8 cache (a scale and an offset per row and head) leaves greedy decoding unchanged."""
    path = resolve(SMOLLM)
    u8 = StageEngine(load_stage(path, 0, load_shape(path).num_layers), EngineSettings(kv_precision="u8"))
    for prompt in PROMPTS.values():
        ids = codec.encode(prompt)
        params = SamplingParams(max_tokens=32)
        assert generate(u8, ids, params).token_ids == generate(smollm_engine, ids, params).token_ids, prompt


@pytest.mark.slow
def test_smollm_in_w8a8_still_knows_the_capital_of_france(codec):
    """w8a8 on a GGUF quantises the inputs of every matmul the file compresses: the first layer moves off
    the one on f32 inputs, and the answer stays."""
    from cascadia.engine.settings import preset

    path = resolve(SMOLLM)
    weights = load_stage(path, 0, load_shape(path).num_layers)
    ids = codec.encode("The capital of France is")
    layers = {}
    for mode in ("int8", "w8a8"):
        engine = StageEngine(weights, preset(mode))
        trace: list[np.ndarray] = []
        engine.open("s")
        engine.step([Segment("s", 0, len(ids))], np.array(ids), trace=trace)
        engine.close("s")
        layers[mode] = trace[0]
        if mode == "w8a8":
            out = generate(engine, ids, SamplingParams(max_tokens=4)).token_ids
            assert codec.decode(out).startswith(" Paris")
    difference = np.sqrt(np.mean((layers["w8a8"] - layers["int8"]) ** 2)) / np.sqrt(np.mean(layers["int8"] ** 2))
    # its attention's inputs are quantised too: 1.1% here (the Inkling preset keeps its attention f32)
    assert 1e-5 < difference <= 0.02


@pytest.mark.slow
def test_smollm_dense_layers_compile_to_the_form_asked_for(smollm_engine):
    """The stage is one compiled model: on the CPU (default) every FFN is compressed matmuls (gate and
    up stacked into one, like q, k and v: four per layer, and the head); as expert slices (the iGPU's
    form) every layer's gate, up and down run as fused expert banks, the file's compressed blocks
    keeping the fused kernel where f32 banks would run grouped on this device."""
    (ops,) = smollm_engine.runtime_ops()
    assert ops.get("GatherMatmul", 0) + ops.get("GatherMatmulCompressed", 0) == 0, ops
    assert ops.get("FullyConnectedCompressed", 0) + ops.get("FullyConnected", 0) == 4 * 30 + 1, ops
    # the first stage's graph embeds the token ids itself: a step is one call
    assert "input_ids" in {port.get_any_name() for port in smollm_engine._runner.model.inputs}
    assert smollm_engine._embed is None
    path = resolve(SMOLLM)
    sliced = StageEngine(load_stage(path, 0, load_shape(path).num_layers), EngineSettings(dense_ffn="experts"))
    (ops,) = sliced.runtime_ops()
    assert ops.get("GatherMatmul", 0) + ops.get("GatherMatmulCompressed", 0) >= 3 * 30, ops


@pytest.mark.slow
def test_smollm_three_shard_processes_equal_one(smollm_engine, codec):
    ids = codec.encode(PROMPTS["code"])
    alone = generate(smollm_engine, ids, SamplingParams(max_tokens=32)).token_ids
    cmd = [sys.executable, "-m", "cascadia.cli", "generate", "--model", SMOLLM, "--shards", "3"]
    cmd += ["--prompt-ids", " ".join(map(str, ids)), "--max-tokens", "32", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["token_ids"] == alone


@pytest.mark.slow
def test_default_fleet_answers_through_the_openai_client(tmp_path, codec):
    """`cascadia up` with no --model: SmolLM2 across 3 shard processes, as the README shows it."""
    import httpx
    import openai
    import psutil

    from cascadia.bench.load import wait_until_ready
    from cascadia.router.local import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "cascadia.cli", "up", "--port", str(port), "--log-dir", str(tmp_path)]
    with open(tmp_path / "up.log", "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, process)
        assert "3 shards" in (tmp_path / "up.log").read_text()
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [SMOLLM]
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        chat = client.chat.completions.create(model=SMOLLM, messages=messages, max_tokens=8, temperature=0)
        assert "Paris" in chat.choices[0].message.content
        assert chat.usage.prompt_tokens == len(codec.encode_chat(messages))
        reply = httpx.post(
            base + "/v1/completions",
            json={"model": SMOLLM, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        ).json()
        assert reply["choices"][0]["text"].startswith(" Paris")
        children = psutil.Process(process.pid).children(recursive=True)
        # three shards, the router, the gateway, the draft service and (where installed) Redis
        assert len(children) == 6 + (shutil.which("redis-server") is not None)
    finally:
        process.terminate()
        process.wait(30)
    # SIGTERM stops the whole fleet, not just `cascadia up`
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def _dequantised_oracle(path: Path, settings):
    """transformers on the very weights the engine computes with (a down projection run as expert
    slices is quantised slice by slice, as plain matmuls whole)."""
    from cascadia.engine.weights import quantize
    from cascadia.model.checkpoint import DENSE_SLICES

    model = _oracle(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 2:
                continue
            w = param.numpy()
            if "mlp.down_proj" in name and settings.dense_ffn_path == "experts":
                n, k = w.shape
                sliced = w.reshape(n, DENSE_SLICES, k // DENSE_SLICES).transpose(1, 0, 2)
                back = dequantize(quantize(sliced, settings.expert_weights)).transpose(1, 0, 2).reshape(n, k)
            elif "mlp." in name:
                back = dequantize(quantize(w, settings.expert_weights))
            elif "self_attn." in name:
                back = dequantize(quantize(w, settings.attention_weights))
            else:  # embedding and head
                back = dequantize(quantize(w, settings.head_weights))
            param.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return model


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "w8a8"])
def test_tiny_llama_low_precision_modes_match_the_dequantised_oracle(tiny_llama, mode):
    """bf16 experts run as bf16-typed ops in the stage's graph; int8/int4 weights with f32 arithmetic;
    w8a8's int8 MLP weights on int8-quantised inputs."""
    from cascadia.engine.settings import preset

    settings = preset(mode)
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), settings)
    ids = np.random.default_rng(6).integers(3, 300, size=24)
    engine.open("s")
    logits = engine.step([Segment("s", 0, len(ids))], ids).logits
    with torch.no_grad():
        ref = _dequantised_oracle(tiny_llama, settings)(torch.tensor(ids[None])).logits[0].numpy()
    rel = np.sqrt(np.mean((logits - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    # the logits, after every layer: w8a8's input rounding adds up to about 1.1% here (per layer it stays
    # within 1%, tests/engine/test_engine_numerics.py)
    bound = {"bf16": 1e-2, "w8a8": 2e-2}.get(mode, 1e-3)
    assert rel <= bound, f"{mode}: relative rms {rel:.2e}"


def test_dense_ffn_as_expert_slices_equals_plain_matmuls(tiny_llama):
    shape = load_shape(tiny_llama)
    weights = load_stage(tiny_llama, 0, shape.num_layers)
    ids = np.random.default_rng(7).integers(3, 300, size=20)
    logits = {}
    for mode in ("experts", "matmul"):
        engine = StageEngine(weights, EngineSettings(dense_ffn=mode))
        engine.open("s")
        logits[mode] = engine.step([Segment("s", 0, len(ids))], ids).logits
    np.testing.assert_allclose(logits["experts"], logits["matmul"], rtol=1e-4, atol=1e-4)


# -- paged attention over block pools -----------------------------------------------------------------


def test_paged_stage_compiles_to_one_fused_attention_per_layer(tiny_llama):
    shape = load_shape(tiny_llama)
    weights = load_stage(tiny_llama, 0, shape.num_layers)
    (paged,) = StageEngine(weights, EngineSettings(llama_attention="paged")).runtime_ops()
    (blocks,) = StageEngine(weights, EngineSettings(llama_attention="blocks")).runtime_ops()
    assert paged.get("PagedAttention") == shape.num_layers
    assert "PagedAttention" not in blocks
    assert sum(paged.values()) < sum(blocks.values())


def test_paged_rewind_and_refeed_equal_a_fresh_stream(tiny_llama):
    """What a rejected speculative draft does: rows past the confirmed position are overwritten."""
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention="paged"))
    rng = np.random.default_rng(8)
    prompt, rejected, accepted = (rng.integers(3, 300, size=n) for n in (30, 6, 5))
    engine.open("spec")
    engine.step([Segment("spec", 0, 30)], prompt)
    engine.step([Segment("spec", 30, 6)], rejected)
    engine.rewind("spec", 31)  # the first drafted token confirmed
    tail = np.concatenate([rejected[:1], accepted])
    got = engine.step([Segment("spec", 31, 5)], accepted).logits
    engine.open("fresh")
    want = engine.step([Segment("fresh", 0, 36)], np.concatenate([prompt, tail])).logits[31:]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_paged_pool_growth_keeps_every_stream_and_close_returns_blocks(tiny_llama):
    """Streams that outgrow the first pool (16 blocks) force a larger one mid-run, bound anew."""
    shape = load_shape(tiny_llama)
    weights = load_stage(tiny_llama, 0, shape.num_layers)
    paged = StageEngine(weights, EngineSettings(llama_attention="paged"))
    blocks = StageEngine(weights, EngineSettings(llama_attention="blocks"))
    rng = np.random.default_rng(9)
    prompts = {name: rng.integers(3, 300, size=200) for name in "abc"}
    pool = paged._pool
    assert pool is not None
    generation = pool.generation
    logits = {}
    for engine in (paged, blocks):
        for name, ids in prompts.items():
            engine.open(name)
            engine.step([Segment(name, 0, 120)], ids[:120])
        # every stream's second window in one step, then a decode row each
        segments = [Segment(name, 120, 79) for name in prompts]
        engine.step(segments, np.concatenate([ids[120:199] for ids in prompts.values()]))
        segments = [Segment(name, 199, 1) for name in prompts]
        logits[engine is paged] = engine.step(segments, np.array([ids[199] for ids in prompts.values()])).logits
    assert pool.generation > generation and pool.capacity >= 3 * 7
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    assert paged.stream_bytes("a") == 7 * pool.block_bytes
    held = paged.held_state_bytes()
    for name in prompts:
        paged.close(name)
    # every block is free again, and the pool is back to its first size
    assert pool.free_blocks == pool.capacity == 16
    assert paged.held_state_bytes() == 16 * pool.block_bytes < held


def test_paged_attention_refuses_u8_keys():
    with pytest.raises(ValueError, match="u8"):
        EngineSettings(llama_attention="paged", kv_precision="u8")
    assert not EngineSettings(kv_precision="u8").paged_attention
    assert not EngineSettings(device="GPU").paged_attention
    assert EngineSettings().paged_attention


def test_paged_last_stage_logits_come_from_its_one_call_and_agree_with_the_head(tiny_llama):
    shape = load_shape(tiny_llama)
    engine = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), EngineSettings(llama_attention="paged"))
    ids = np.random.default_rng(10).integers(3, 300, size=12)
    engine.open("s")
    step = engine.step([Segment("s", 0, 12)], ids, np.array([3, 11]))
    assert step.logits.shape == (2, shape.vocab_size) and step.logit_rows.tolist() == [3, 11]
    np.testing.assert_allclose(step.logits, engine.head_logits(step.hidden[[3, 11]]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logit rows"):
        engine.step([Segment("s", 12, 1)], ids[:1], np.array([1]))
    assert engine.position("s") == 12  # the refused step left the stream where it was


def test_models_compiled_when_first_needed_read_the_weights_again_and_agree(tiny_llama):
    """An engine given `reload` keeps no weights for its trace model and lone head: it reads them again
    the first time each is needed, and computes what an engine that kept them computes."""
    shape = load_shape(tiny_llama)
    reads: list[int] = []

    def reload():
        reads.append(1)
        return load_stage(tiny_llama, 0, shape.num_layers)

    settings = EngineSettings(llama_attention="paged")
    lean = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), settings, reload=reload)
    kept = StageEngine(load_stage(tiny_llama, 0, shape.num_layers), settings)
    assert reads == []
    ids = np.random.default_rng(12).integers(3, 300, size=12)
    traces: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    steps = []
    for engine, trace in zip((lean, kept), traces, strict=True):
        engine.open("s")
        steps.append(engine.step([Segment("s", 0, 12)], ids, trace=trace))
    assert len(reads) == 1 and len(traces[0]) == shape.num_layers
    for ours, theirs in zip(*traces, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    heads = [engine.head_logits(step.hidden[[2, 11]]) for engine, step in zip((lean, kept), steps, strict=True)]
    assert len(reads) == 2
    np.testing.assert_allclose(heads[0], heads[1], rtol=1e-6, atol=1e-6)
