"""The Llama model and its runner: shapes, RoPE/GQA against a naive reference written
differently (complex-number RoPE, explicit head repetition, one dense causal softmax per
sequence), HF-checkpoint loading, and cached inference against full-sequence recompute."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sightline.engine.config import PRESETS, EngineConfig, ModelConfig
from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
from sightline.engine.model import AttentionMetadata, build_model
from sightline.engine.model_runner import ModelRunner
from sightline.engine.request import Request, SamplingParams
from sightline.engine.scheduler import Scheduler, SchedulerConfig
from sightline.engine.tokenizer import ByteTokenizer

SMALL = ModelConfig(name="small", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                    rope_theta=500.0, init_std=0.2)


def _hf_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under HF Llama names (separate q/k/v and gate/up)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    h, d = cfg.hidden_size, cfg.head_dim
    state = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "model.norm.weight": 1 + rnd(h),
             "lm_head.weight": rnd(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": rnd(cfg.num_heads * d, h),
                  p + "self_attn.k_proj.weight": rnd(cfg.num_kv_heads * d, h),
                  p + "self_attn.v_proj.weight": rnd(cfg.num_kv_heads * d, h),
                  p + "self_attn.o_proj.weight": rnd(h, cfg.num_heads * d),
                  p + "mlp.gate_proj.weight": rnd(cfg.intermediate_size, h),
                  p + "mlp.up_proj.weight": rnd(cfg.intermediate_size, h),
                  p + "mlp.down_proj.weight": rnd(h, cfg.intermediate_size),
                  p + "input_layernorm.weight": 1 + rnd(h),
                  p + "post_attention_layernorm.weight": 1 + rnd(h)}
    return state


def _naive_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [L, V] in float64, straight from the Llama paper's equations."""
    w = {k: v.double() for k, v in w.items()}
    n, d, hq, hkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    # RoPE as complex rotation of the pairs (j, j + d/2): the HF "rotate half" layout.
    freqs = cfg.rope_theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                      torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :])

    def rope(x):  # [n, H, d]
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    x = w["model.embed_tokens.weight"][ids]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = norm(x, w[p + "input_layernorm.weight"])
        q = rope((a @ w[p + "self_attn.q_proj.weight"].T).view(n, hq, d))
        k = rope((a @ w[p + "self_attn.k_proj.weight"].T).view(n, hkv, d))
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(n, hkv, d)
        out = torch.empty(n, hq, d, dtype=torch.float64)
        for head in range(hq):
            kv_head = head * hkv // hq  # GQA: consecutive query heads share a KV head
            scores = q[:, head] @ k[:, kv_head].T / d ** 0.5 + mask
            out[:, head] = torch.softmax(scores, -1) @ v[:, kv_head]
        x = x + out.reshape(n, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        m = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def _write_hf_dir(tmp_path, cfg: ModelConfig, state) -> None:
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": [2, 3]}))
    names = sorted(state)
    half = len(names) // 2  # two shards, as real checkpoints come
    save_file({k: state[k].contiguous() for k in names[:half]}, str(tmp_path / "model-00001.safetensors"))
    save_file({k: state[k].contiguous() for k in names[half:]}, str(tmp_path / "model-00002.safetensors"))


def _prefill_meta(lengths: list[int]) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(num_prefill_tokens=int(cu[-1]), slot_mapping=None, cu_seqlens_q=cu,
                             cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                             backend="torch")


def test_presets_have_llama_shapes():
    assert PRESETS["llama-8b"].num_params == pytest.approx(8.03e9, rel=0.01)
    assert PRESETS["llama-1b"].num_params == pytest.approx(1.24e9, rel=0.01)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ModelConfig(name="x", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=4, num_kv_heads=3, head_dim=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="device='tpu'"):
        EngineConfig(device="tpu")


def test_shapes_and_seeded_random_weights():
    model = build_model(PRESETS["tiny"], "cpu", torch.float32, seed=7)
    again = build_model(PRESETS["tiny"], "cpu", torch.float32, seed=7)
    other = build_model(PRESETS["tiny"], "cpu", torch.float32, seed=8)
    ids = torch.randint(0, 512, (10,))
    meta = _prefill_meta([6, 4])
    pos = torch.tensor([*range(6), *range(4)])
    logits = model(ids, pos, meta, None, torch.tensor([5, 9]))
    assert logits.shape == (2, 512) and logits.dtype == torch.float32
    assert torch.equal(logits, again(ids, pos, meta, None, torch.tensor([5, 9])))
    assert not torch.allclose(logits, other(ids, pos, meta, None, torch.tensor([5, 9])))
    assert model(ids, pos, meta).shape == (10, 512)


def test_hf_checkpoint_matches_naive_reference(tmp_path):
    state = _hf_state(SMALL, seed=0)
    _write_hf_dir(tmp_path, SMALL, state)
    cfg = ModelConfig.from_hf_dir(tmp_path)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.eos_token_id, cfg.bos_token_id) == (2, 16, 2, 1)
    model = build_model(cfg, "cpu", torch.float32)
    rng = random.Random(0)
    seqs = [[rng.randrange(97) for _ in range(n)] for n in (13, 1, 40)]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    got = model(ids, pos, _prefill_meta([len(s) for s in seqs]))  # [54, V], one packed batch
    want = torch.cat([_naive_logits(SMALL, state, s) for s in seqs])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # A checkpoint missing a tensor is refused with its name.
    state.pop("model.layers.1.mlp.up_proj.weight")
    bad = tmp_path / "bad"
    bad.mkdir()
    _write_hf_dir(bad, SMALL, state)
    with pytest.raises(ValueError, match="lacks 1 tensors.*layers.1.mlp.gate_up_proj"):
        build_model(ModelConfig.from_hf_dir(bad), "cpu", torch.float32)


def _runner(tmp_path, **kw) -> tuple[ModelRunner, ModelConfig, dict]:
    state = _hf_state(SMALL, seed=1)
    _write_hf_dir(tmp_path, SMALL, state)
    cfg = ModelConfig.from_hf_dir(tmp_path)
    econf = EngineConfig(model=str(tmp_path), device="cpu", block_size=8, kv_cache_gib=0.001,
                         attention_backend="torch", scheduler=SchedulerConfig(**kw))
    return ModelRunner(econf, cfg), cfg, state


def test_cached_steps_match_full_recompute(tmp_path):
    """Chunked prefill (a chunk continuing a cached prefix), paged decode, preemption and mixed
    prefill+decode batches, through the real scheduler: every greedy token equals the argmax of
    the naive full-sequence logits of the text so far."""
    runner, cfg, state = _runner(tmp_path, max_num_seqs=4, max_num_batched_tokens=16)
    # Few blocks force preemption: 7 blocks of 8 tokens for 4 requests of 94 tokens in all.
    kv = KVCacheManager(KVCacheConfig(block_size=8, num_blocks=7))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    rng = random.Random(3)
    requests = [Request(f"r{i}", [rng.randrange(97) for _ in range(n)],
                        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
                for i, (n, m) in enumerate([(30, 6), (5, 12), (20, 9), (9, 3)])]
    for r in requests:
        sched.add(r)
    steps = mixed = chunked = preempted = 0
    while sched.has_work:
        plan = sched.schedule()
        preempted += len(plan.preempted)
        chunked += any(e.computed_before > 0 and e.num_new_tokens > 1 for e in plan.scheduled)
        kinds = {e.num_new_tokens == 1 and e.computed_before > 0 for e in plan.scheduled}
        mixed += kinds == {True, False}
        sampled = runner.execute(plan)
        sched.update(plan, sampled)
        kv.check_invariants()
        steps += 1
    assert chunked and mixed and preempted, (chunked, mixed, preempted)
    for r in requests:
        assert len(r.output_token_ids) == r.sampling.max_tokens
        full = r.all_token_ids
        want = _naive_logits(cfg, state, full[:-1])[r.num_prompt_tokens - 1:].argmax(-1).tolist()
        assert r.output_token_ids == want, r.request_id
    assert kv.num_used_blocks == 0


# ---- sampling and detokenization ---------------------------------------------------------------
def _batch(temps, top_ps, gens):
    from sightline.engine.sampling import SamplingBatch
    return SamplingBatch(torch.tensor(temps, dtype=torch.float32), torch.tensor(top_ps, dtype=torch.float32),
                         gens, all(t == 0 for t in temps), any(p < 1 for p in top_ps))


def test_sampler_greedy_top_p_and_per_request_seeds():
    from sightline.engine.sampling import Sampler
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(20000, 1)  # [S, 4]
    # Greedy rows ignore the noise entirely.
    assert sampler.sample(logits[:3], _batch([0.0] * 3, [1.0] * 3, [None] * 3)).tolist() == [0, 0, 0]
    # top_p=0.8 keeps {0, 1} (the mass strictly before token 2 is 0.8): 0.625 / 0.375 after renormalizing.
    drawn = sampler.sample(logits, _batch([1.0] * 20000, [0.8] * 20000, [None] * 20000))
    freq = torch.bincount(drawn, minlength=4).double() / 20000
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0].item() - 0.625) < 0.015
    # Without top_p every token appears at its probability (temperature 1).
    drawn = sampler.sample(logits, _batch([1.0] * 20000, [1.0] * 20000, [None] * 20000))
    freq = torch.bincount(drawn, minlength=4).double() / 20000
    torch.testing.assert_close(freq, probs.double(), atol=0.015, rtol=0)
    # A seeded request draws the same tokens whatever shares its batch.
    wide = torch.randn(6, 512)
    alone = [sampler.sample(wide[2:3], _batch([0.9], [0.95], [sampler.generator_for("a", 42)])).item()
             for _ in range(5)]
    sampler.release("a")
    mixed = []
    for _ in range(5):
        gens = [None, sampler.generator_for("b", 7), sampler.generator_for("a", 42), None, None, None]
        mixed.append(sampler.sample(wide, _batch([1.0, 0.5, 0.9, 0.0, 1.0, 1.0], [1.0, 0.9, 0.95, 1.0, 0.5, 1.0],
                                                 gens))[2].item())
    assert mixed == alone and len(set(alone)) > 1
    sampler.release("a"), sampler.release("b")
    assert sampler.num_generators == 0


def test_incremental_detokenizer_never_splits_a_character():
    from sightline.engine.tokenizer import IncrementalDetokenizer
    tok = ByteTokenizer()
    text = "héllo ✓ 日本 🙂!"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in tok.encode(text, add_bos=False)]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # 0xC3 waits for 0xA9
    # Specials and ids past the byte range decode to nothing; a dangling lead byte flushes as U+FFFD.
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(t) for t in (ByteTokenizer.BOS, 300, ord("a"), 0xE2)] == ["", "", "a", ""]
    assert detok.flush() == "\ufffd"


_TRITON_ENGINE_SCRIPT = """
import json, os, random
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
out = {}
for backend in ("triton", "torch"):
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_gib=0.002, attention_backend=backend,
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)))
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (20, 5)]
    done = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    out[backend] = [r.output_token_ids for r in done]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_engine_on_triton_kernels_matches_torch_path():
    """The GPU path's kernels (the Triton FA2 prefill and paged decode), run by the Triton CPU
    interpreter inside the whole engine: chunked prefill, a mixed step, decodes. Same greedy
    tokens as the torch path. (~10 s: the interpreter is slow.)"""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_ENGINE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["triton"] == out["torch"] and len(out["torch"]) == 2


def test_checkpoint_dir_with_tokenizer_json(tmp_path):
    """A local HF-style directory: config.json + safetensors + tokenizer.json (read by the
    optional ``tokenizers`` package) serves text through the engine, EOS id from config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from sightline.engine.llm_engine import LLMEngine
    from sightline.engine.tokenizer import HFTokenizer, load_tokenizer

    corpus = ["the quick brown fox jumps over the lazy dog", "sightline traces every step"] * 50
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=97, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    _write_hf_dir(tmp_path, SMALL, _hf_state(SMALL, seed=2))  # bos 1, eos [2, 3] -> 2
    loaded = load_tokenizer(str(tmp_path), 1, 2)
    assert isinstance(loaded, HFTokenizer)
    ids = loaded.encode("the lazy fox")
    assert ids[0] == 1 and max(ids) < 97 and loaded.decode(ids) == "the lazy fox"
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_gib=0.001))
    assert engine.model_name == tmp_path.name and engine.eos_token_id == 2
    [done] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))
    assert 1 <= len(done.output_token_ids) <= 8
    assert done.finish_reason.value == ("stop" if done.output_token_ids[-1] == 2 else "length")


def test_paged_prefill_then_decode_logits_equal_full_sequence_logits():
    """Logits, not just argmax: a prompt prefilled in two chunks (the second attends to the
    first through the paged cache), then decoded one token at a time next to another
    sequence's prefill, equal the cache-less full-sequence logits at every position."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, "cpu", torch.float32, seed=3)
    bs, hkv, d = 4, cfg.num_kv_heads, cfg.head_dim
    cache = torch.zeros(cfg.num_layers, 2, 32, bs, hkv, d)
    rng = random.Random(5)
    seq_a = [rng.randrange(512) for _ in range(19)]
    seq_b = [rng.randrange(512) for _ in range(7)]
    blocks_a = rng.sample(range(32), 5)  # scattered pages: 5 * 4 slots >= 19 tokens
    blocks_b = [b for b in range(32) if b not in blocks_a][:2]

    def slots(blocks, start, end):
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def full(seq):
        n = len(seq)
        return model(torch.tensor(seq), torch.arange(n), _prefill_meta([n]))  # [n, V]

    def step(prefills, decodes):
        """prefills: [(seq, blocks, start, end)], decodes: [(seq, blocks, pos)] -> logits of every token."""
        ids, pos, sl, cu_q, cu_k, kv = [], [], [], [0], [0], []
        for seq, blocks, start, end in prefills:
            ids += seq[start:end]
            pos += range(start, end)
            sl += slots(blocks, start, end)
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
            kv += slots(blocks, 0, end)
        n_pre = len(ids)
        tables, lens = [], []
        for seq, blocks, p in decodes:
            ids.append(seq[p])
            pos.append(p)
            sl += slots(blocks, p, p + 1)
            tables.append(blocks + [0] * (5 - len(blocks)))
            lens.append(p + 1)
        meta = AttentionMetadata(
            num_prefill_tokens=n_pre, slot_mapping=torch.tensor(sl),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32) if prefills else None,
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32) if prefills else None,
            max_seqlen_q=max((e - s for _, _, s, e in prefills), default=0),
            max_seqlen_k=max((e for *_, e in prefills), default=0),
            prefill_kv_slots=torch.tensor(kv) if any(s > 0 for _, _, s, _ in prefills) else None,
            block_tables=torch.tensor(tables, dtype=torch.int32) if decodes else None,
            context_lens=torch.tensor(lens, dtype=torch.int32) if decodes else None, backend="torch")
        return model(torch.tensor(ids), torch.tensor(pos), meta, cache)

    want_a, want_b = full(seq_a), full(seq_b)
    got = step([(seq_a, blocks_a, 0, 10)], [])
    torch.testing.assert_close(got, want_a[:10], rtol=1e-4, atol=1e-4)
    got = step([(seq_a, blocks_a, 10, 15)], [])  # chunk over a cached prefix
    torch.testing.assert_close(got, want_a[10:15], rtol=1e-4, atol=1e-4)
    for p in range(15, 19):  # decodes of a, batched with b's prefill chunks
        s, e = 2 * (p - 15), min(7, 2 * (p - 15) + 2)
        got = step([(seq_b, blocks_b, s, e)], [(seq_a, blocks_a, p)])
        torch.testing.assert_close(got[e - s:], want_a[p:p + 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[:e - s], want_b[s:e], rtol=1e-4, atol=1e-4)
