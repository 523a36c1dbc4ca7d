"""MoE LoRA training speed: this trainer against plain PEFT with ``target_parameters`` (what TuFT runs), on the same
random-init Qwen3-MoE, the same tokens and the same LoRA, in the same run.

Measured, one after another (one model in memory at a time), each a whole training step (forward + backward of a
``cross_entropy`` loss over every token + one AdamW step), LoRA rank ``--rank`` on every weight group (attention,
routed experts, output head):

1. this trainer in-process: ``MultiLoRATrainer.forward_backward_batch`` + ``optim_step``; the routed experts get one
   low-rank pair per expert, computed with grouped matmuls over the tokens routed to each (``adapters.lora.experts``);
2. plain PEFT 0.21: ``LoraConfig(target_modules=[attention linears, lm_head], target_parameters=[the experts'
   gate_up_proj, down_proj])``, full logits, weighted token logprobs, backward, ``torch.optim.AdamW``; PEFT folds
   each expert's ``scale · B·A`` into a copy of the whole 3-D expert weight on every forward, then runs transformers'
   own experts implementation on it;
3. this trainer through the server (started with its default flags, ``--base-model DIR``), driven by the unmodified
   tinker SDK: ``forward_backward`` + ``optim_step`` round trips; with ``--trainer-shards`` 1 and 2 (``--shards``),
   each shard's memory after the steps (resident and peak, the run's adapter state and base weights it holds).

Before any timing, the first step is checked: both start from the same LoRA weights (B ≠ 0; the trainer's gate and up
pairs of each expert share their A, so that PEFT's single pair on the fused ``gate_up_proj`` holds exactly the same
adapter), and the two losses and every LoRA gradient are compared and printed.

    python -m bench.moe_lora [--shape cpu-moe|cpu-128x8|qwen3-30b-a3b] [--layers N] [--rows R] [--length T]
                             [--rank 32] [--repeats 3] [--server-steps 3] [--threads N] [--no-server]
                             [--shards 1 2]
                             [--server-arg=--flag ...]

``cpu-128x8`` has Qwen3-30B-A3B's 128 experts, top-8, at a CPU's widths (hidden 256, expert width 128, 2 layers).
``qwen3-30b-a3b`` has Qwen3-30B-A3B's real dimensions (hidden 2048, 32/4 heads of 128, 128 experts top-8, expert
width 768, vocabulary 151,936) with ``--layers`` of its 48 layers (default 8: PEFT's merged expert weights, kept for
backward, need ≈ 1.2 GB per layer in bf16 on top of the model).
"""

from __future__ import annotations

import argparse
import gc
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from adapters.trainer.actor import LORA_ALPHA, AdamHyper, LoraSpec, MultiLoRATrainer, StepRequest
from adapters.trainer.options import TrainerOptions
from bench.common import device_name, mfu, write
from shims.tinker.training_wire import DatumArrays

SHAPES = {
    # Qwen3MoeConfig settings; every layer MoE, no shared expert, like the published Qwen3 MoE models.
    "cpu-moe": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                "intermediate_size": 1024, "vocab_size": 8192},
    # Qwen3-30B-A3B's expert count and top-k at a CPU's widths and depth: its adapter, like the real one's, is almost
    # all experts' (97% here at any rank, 98% there).
    "cpu-128x8": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 64, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 128,
                  "intermediate_size": 1024, "vocab_size": 8192},
    "qwen3-30b-a3b": {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936},
}
DEFAULTS = {"cpu-moe": {"layers": 4, "rows": 4, "length": 256}, "cpu-128x8": {"layers": 2, "rows": 8, "length": 256},
            "qwen3-30b-a3b": {"layers": 8, "rows": 8, "length": 1024}}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LEARNING_RATE = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="cpu-moe", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--rows", type=int, help="datums per step (default: the shape's)")
    parser.add_argument("--length", type=int, help="tokens per datum (default: the shape's)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up (median reported)")
    parser.add_argument("--server-steps", type=int, default=3, help="timed SDK round trips (median reported)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads of every measurement, the server's trainer included (it then runs "
                             "with --trainer-threads N); default: torch's choice here, the server's own there (both "
                             "this machine's CPUs)")
    parser.add_argument("--no-server", action="store_true", help="skip the measurements through the server")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2],
                        help="measure through the server with each of these --trainer-shards (default: 1 2)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra server flag, e.g. --server-arg=--sampler-backend=transformers (repeatable)")
    args = parser.parse_args()
    for key, value in DEFAULTS[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads_given = args.threads is not None
    args.threads = torch.get_num_threads()  # both in-process measurements compute with these (the trainer sets its own)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device_name()}")
    directory = build_model(args.shape, args.layers)
    data = make_data(SHAPES[args.shape]["vocab_size"], args.rows, args.length)
    tokens = args.rows * args.length
    active = active_params(args.shape, args.layers)
    rows: list[dict] = []

    def record(workload: str, seconds: float, extra: dict | None = None) -> None:
        rate = tokens / seconds
        rows.append({"workload": workload, "tokens_per_step": tokens, "seconds_per_step": seconds,
                     "tokens_per_second": rate, "mfu": mfu(active, rate), **(extra or {})})

    adapter = adapter_tensors(directory, args.rank)
    ours = trainer_phase(directory, data, args, adapter)
    _free()  # each phase's model goes with its function's frame: one model in memory at a time
    record("this trainer, in-process", ours["seconds"], {"peak_gb": ours["peak_gb"]})
    torch.set_num_threads(args.threads)
    peft = peft_phase(directory, data, args, adapter, device)
    _free()
    record("plain PEFT (target_parameters)", peft["seconds"], {"peak_gb": peft["peak_gb"]})
    check = compare_first_step(ours, peft, device)
    for shards in () if args.no_server else args.shards:
        workload = "this trainer, tinker SDK → server (default flags)" + (
            f" --trainer-shards {shards}" if shards > 1 else "")
        try:
            seconds, held = server_phase(directory, data, args, shards)
            record(workload, seconds, {"shards": held})
        except Exception as exc:  # noqa: BLE001 - the in-process figures still stand; say why this one is missing
            traceback.print_exc()
            rows.append({"workload": workload, "error": f"{type(exc).__name__}: {str(exc)[-2000:]}"})
    baseline = rows[1]["tokens_per_second"]
    for row in rows:
        if "tokens_per_second" in row:
            row["relative_to_plain_peft"] = row["tokens_per_second"] / baseline
    config = {**vars(args), "model": {**SHAPES[args.shape], "num_hidden_layers": args.layers},
              "active_non_embedding_params": active, "first_step_check": check}
    write(f"moe_lora-{args.shape}", config, rows)
    shutil.rmtree(directory, ignore_errors=True)


# ---- the model and the data ------------------------------------------------------------------------------------------
def build_model(shape: str, layers: int) -> Path:
    """A random-init Qwen3-MoE of ``shape`` (seeded; bfloat16 on a GPU), saved with the tiny model's tokenizer files
    beside it (the server's samplers load a tokenizer; the benchmark feeds token ids directly)."""
    from transformers import Qwen3MoeConfig

    from adapters.models.tiny import save_random_model

    config = Qwen3MoeConfig(**{**SHAPES[shape], "num_hidden_layers": layers}, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32768,
                            tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    cuda = torch.cuda.is_available()  # built on the GPU there: the qwen3-30b-a3b shape takes minutes on a CPU
    directory = save_random_model(config, Path(tempfile.mkdtemp(prefix=f"bench-{shape}-")),
                                  torch.bfloat16 if cuda else None, "cuda" if cuda else "cpu")
    _free()
    return directory


def make_data(vocab: int, rows: int, length: int) -> list[DatumArrays]:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(rows):
        seq = rng.integers(0, vocab, size=length + 1)
        data.append(DatumArrays(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:],
                                                                  "weights": np.ones(length, np.float32)}))
    return data


def active_params(shape: str, layers: int) -> int:
    """Non-embedding parameters one token goes through (attention + its top-k experts), for MFU (6·N·tokens/s)."""
    s = SHAPES[shape]
    hidden, head_dim = s["hidden_size"], s["head_dim"]
    attn = hidden * head_dim * 2 * (s["num_attention_heads"] + s["num_key_value_heads"])
    experts = s["num_experts_per_tok"] * 3 * hidden * s["moe_intermediate_size"]
    return layers * (attn + experts)


def adapter_tensors(directory: Path, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One LoRA adapter by the trainer's slot keys, with B ≠ 0, that PEFT can hold exactly: each expert's gate and
    up pairs share their A (PEFT has one pair over the fused ``gate_up_proj``, whose B then stacks the two Bs)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(directory)
    hidden, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    experts, width = c.num_experts, c.moe_intermediate_size
    g = torch.Generator().manual_seed(1)

    def pair(inputs: int, outputs: int, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        a = (torch.rand((*lead, rank, inputs), generator=g) * 2 - 1) / inputs ** 0.5
        return a, torch.randn((*lead, outputs, rank), generator=g) * 0.02

    tensors = {}
    for layer in range(c.num_hidden_layers):
        attn = f"model.layers.{layer}.self_attn"
        for leaf, (inputs, outputs) in {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                                        "o_proj": (q, hidden)}.items():
            tensors[f"{attn}.{leaf}"] = pair(inputs, outputs)
        mlp = f"model.layers.{layer}.mlp.experts"
        a, gate_b = pair(hidden, width, (experts,))
        tensors[f"{mlp}.gate_proj"] = (a, gate_b)
        tensors[f"{mlp}.up_proj"] = (a.clone(), pair(hidden, width, (experts,))[1])
        tensors[f"{mlp}.down_proj"] = pair(width, hidden, (experts,))
    tensors["lm_head"] = pair(hidden, c.vocab_size)
    return tensors


# ---- the three measurements ------------------------------------------------------------------------------------------
def trainer_phase(directory: Path, data: list[DatumArrays], args, adapter: dict) -> dict:
    """The first step from ``adapter`` (loss and gradients kept for the check), then the timed steps."""
    # The trainer sets its own torch threads (this machine's CPUs unless told): --threads holds for it too.
    trainer = MultiLoRATrainer(str(directory), TrainerOptions(threads=args.threads))
    trainer.create("bench", LoraSpec(rank=args.rank, seed=0))
    model, name = trainer.model, trainer.adapters["bench"].name
    slots = [slot.key for module in model.modules.values() if name in module.lora
             for slot in module.lora.slots]
    missing = sorted(set(slots) ^ set(adapter))
    if missing:
        raise SystemExit(f"the trainer adapts other weights than this benchmark expects, e.g. {missing[:3]}")
    by_key = {slot.key: pair for module in model.modules.values() if name in module.lora
              for slot, pair in zip(module.lora.slots, module.lora.pairs[name], strict=True)}
    with torch.no_grad():
        for key, (a, b) in adapter.items():
            by_key[key][0].copy_(a)
            by_key[key][1].copy_(b)
    request = [StepRequest("bench", data, "cross_entropy", {}, False)]
    adam = AdamHyper(learning_rate=LEARNING_RATE)
    _reset_peak()
    result = trainer.forward_backward_batch(request)[0]
    if isinstance(result, Exception):
        raise result
    grads = {key: (a.grad.detach().float().cpu(), b.grad.detach().float().cpu()) for key, (a, b) in by_key.items()}
    trainer.optim_step("bench", adam)

    def step() -> None:
        outcome = trainer.forward_backward_batch(request)[0]
        if isinstance(outcome, Exception):
            raise outcome
        trainer.optim_step("bench", adam)

    seconds = _timed(args.repeats, step)
    peak = _peak_gb()
    return {"loss": result.metrics["loss:sum"], "grads": grads, "seconds": seconds, "peak_gb": peak}


def peft_phase(directory: Path, data: list[DatumArrays], args, adapter: dict, device: torch.device) -> dict:
    """What a PEFT user (TuFT) writes for the same step: one batch through ``get_peft_model`` with
    ``target_parameters`` on the experts, full logits, weighted token logprobs, backward, ``torch.optim.AdamW`` (its
    default implementation for the device). The LoRA starts as ``adapter``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA, target_modules=[*ATTENTION, "lm_head"],
                                            target_parameters=EXPERT_PARAMETERS))
    pairs = peft_pairs(model)
    expected = {k for k in adapter if not k.endswith((".gate_proj", ".up_proj"))} | {
        k.removesuffix(".gate_proj") + ".gate_up_proj" for k in adapter if k.endswith(".gate_proj")}
    if set(pairs) != expected:
        raise SystemExit(f"PEFT adapted other weights than this benchmark expects: {sorted(set(pairs) ^ expected)[:5]}")
    with torch.no_grad():
        for key, (a, b) in pairs.items():
            target_a, target_b = peft_layout(key, adapter, pairs[key])
            a.copy_(target_a)
            b.copy_(target_b)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    ids = torch.tensor(np.stack([d.tokens for d in data]), device=device)
    targets = torch.tensor(np.stack([d.loss_fn_inputs["target_tokens"] for d in data]), device=device)
    weights = torch.tensor(np.stack([d.loss_fn_inputs["weights"] for d in data]), device=device)

    def forward_backward() -> float:
        logits = model(input_ids=ids).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(2, targets[..., None])[..., 0]
        loss = -(logprobs * weights).sum()
        loss.backward()
        return float(loss.detach())

    def step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _reset_peak()
    loss = forward_backward()
    grads = {key: (a.grad.detach().float().cpu(), b.grad.detach().float().cpu()) for key, (a, b) in pairs.items()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = _timed(args.repeats, step)
    peak = _peak_gb()
    return {"loss": loss, "grads": grads, "seconds": seconds, "peak_gb": peak}


def peft_pairs(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's LoRA weights (A, B: ``lora_A.default.weight``, ``lora_B.default.weight``) by the trainer's module path
    (``model.layers.0.self_attn.q_proj``, ``lm_head``; an expert parameter as ``….mlp.experts.gate_up_proj``)."""
    from peft.tuners.lora.layer import ParamWrapper

    pairs = {}
    for path, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        clean = re.sub(r"^base_model\.model\.", "", path).replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            clean = f"{clean}.{module.parameter_name}"
        pairs[clean] = (module.lora_A["default"].weight, module.lora_B["default"].weight)
    return pairs


def peft_layout(key: str, adapter: dict, peft_pair: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's pair(s) for PEFT's weights ``key``, in PEFT's layout. A 2-D pair is the same matrices. For a
    3-D expert parameter PEFT keeps one ``nn.Linear`` pair: A ``(experts·rank, in)`` (expert-major) and B
    ``(out, rank·experts)`` (expert-minor); for ``gate_up_proj`` B's rows are the gate's then the up's (the trainer's
    gate and up As are equal, see ``adapter_tensors``)."""
    if not key.endswith(("gate_up_proj", "down_proj")) or "experts" not in key:
        return adapter[key]
    prefix = key.rsplit(".", 1)[0]
    if key.endswith("gate_up_proj"):
        a, gate_b = adapter[f"{prefix}.gate_proj"]
        b = torch.cat([gate_b, adapter[f"{prefix}.up_proj"][1]], dim=1)  # (experts, 2·width, rank)
    else:
        a, b = adapter[key]
    experts, rank, inputs = a.shape
    outputs = b.shape[1]
    peft_a = a.reshape(experts * rank, inputs)
    peft_b = b.permute(1, 2, 0).reshape(outputs, rank * experts)  # [o, r, e] → column r·E + e
    if peft_a.shape != peft_pair[0].shape or peft_b.shape != peft_pair[1].shape:
        raise SystemExit(f"PEFT's {key} has shapes {list(peft_pair[0].shape)}, {list(peft_pair[1].shape)}; "
                         f"expected {list(peft_a.shape)}, {list(peft_b.shape)}")
    return peft_a, peft_b


def compare_first_step(ours: dict, peft: dict, device: torch.device) -> dict:
    """The first step's losses and every LoRA gradient, the trainer's mapped to PEFT's layout (a shared A's gradient
    is the sum of the gate's and the up's). Printed, and kept in the results."""
    mapped = {}
    for key in peft["grads"]:
        mapped[key] = peft_layout(key, ours["grads"], peft["grads"][key]) if not key.endswith("gate_up_proj") else (
            _gate_up_grads(key, ours["grads"], peft["grads"][key]))
    worst, where = 0.0, ""
    for key, (a, b) in peft["grads"].items():
        for theirs, mine in ((a, mapped[key][0]), (b, mapped[key][1])):
            gap = float((theirs - mine).abs().max() / theirs.abs().max().clamp_min(1e-30))
            if gap > worst:
                worst, where = gap, key
    loss_gap = abs(ours["loss"] - peft["loss"]) / abs(peft["loss"])
    tolerance = 1e-4 if device.type == "cpu" else 3e-2
    check = {"loss_this_trainer": ours["loss"], "loss_peft": peft["loss"], "loss_relative_gap": loss_gap,
             "grad_max_relative_gap": worst, "grad_worst_tensor": where, "tolerance": tolerance,
             "agree": loss_gap <= tolerance and worst <= tolerance}
    print(f"first step from the same LoRA weights (B ≠ 0): loss {ours['loss']:.6f} (this trainer) vs "
          f"{peft['loss']:.6f} (PEFT), relative gap {loss_gap:.2e}; LoRA gradients: largest relative gap {worst:.2e} "
          f"({where}) — {'agree' if check['agree'] else 'DO NOT AGREE'} within {tolerance:g}")
    return check


def _gate_up_grads(key: str, grads: dict, peft_pair) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = key.rsplit(".", 1)[0]
    (gate_a, gate_b), (up_a, up_b) = grads[f"{prefix}.gate_proj"], grads[f"{prefix}.up_proj"]
    return peft_layout(key, {f"{prefix}.gate_proj": (gate_a + up_a, gate_b), f"{prefix}.up_proj": (up_a, up_b)},
                       peft_pair)


def server_phase(directory: Path, data: list[DatumArrays], args, shards: int) -> tuple[float, list[dict]]:
    """Seconds per SDK ``forward_backward`` + ``optim_step`` round trip against the server (median), started with
    its default flags and ``--trainer-shards shards``; and per trainer process, after the steps and a second run
    trained the same way, what it holds: its resident memory and peak (``VmRSS`` / ``VmHWM``), what the second run
    added to it, and the bytes of the runs' adapter state and of base weights in it (``/api/v1/metrics``, read inside
    the process)."""
    import httpx
    import tinker
    from tinker import types

    from bench.activation_memory import _status_kib
    from tests.server import start_server

    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(d.tokens.tolist()), loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs["weights"]}) for d in data]
    adam = types.AdamParams(learning_rate=LEARNING_RATE)
    flags = ("--trainer-shards", str(shards)) if shards > 1 else ()
    if args.threads_given:  # the server computes with the threads PEFT had (its default: this machine's CPUs)
        flags += ("--trainer-threads", str(args.threads))
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-moe-server-")), "--base-model", str(directory),
                          *flags, *args.server_arg, timeout=900)
    def trainer() -> list[dict]:
        time.sleep(3)  # the pool reads what each process holds every 2 s
        return httpx.get(f"{server.base_url}/api/v1/metrics", headers={"X-API-Key": server.admin_key}).json()[
            "training"][str(directory)]["shards"]

    def rss() -> dict[int, int]:
        return {shard["pid"]: _status_kib(shard["pid"], "VmRSS") for shard in trainer()}

    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model=str(directory), rank=args.rank, seed=0).result()

        def step(client=client) -> None:
            client.forward_backward(sdk_data, "cross_entropy").result()
            client.optim_step(adam).result()

        seconds = _timed(args.server_steps, step)
        # What one more run costs each process: a second run trained the same way, once the passes' memory is
        # there (the allocator keeps it, whatever the runs).
        before = rss()
        second = service.create_lora_training_client(base_model=str(directory), rank=args.rank, seed=1).result()
        for _ in range(2):
            step(second)
        held = [{"rank": shard["rank"], "adapter_state_mib": shard["adapter_bytes"] / 2**20,
                 "base_weights_mib": shard["base_bytes"] / 2**20,
                 "rss_mib": _status_kib(shard["pid"], "VmRSS") / 1024,
                 "rss_per_run_mib": (_status_kib(shard["pid"], "VmRSS") - before[shard["pid"]]) / 1024,
                 "peak_rss_mib": _status_kib(shard["pid"], "VmHWM") / 1024} for shard in trainer()]
        service.close("success")
        return seconds, held
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _timed(repeats: int, step: Callable[[], None]) -> float:
    step()  # warm-up
    _sync()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        _sync()
        seconds.append(time.perf_counter() - started)
    return float(np.median(seconds))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
