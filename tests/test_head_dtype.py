"""--head-dtype: the output head's logits in float32 from bf16 weights in the trainer (utils/models.py Fp32Head) and
in the vLLM engine (utils/vllm_engine.py start_engine's hf_overrides) alike, or in the weights' dtype on both sides.
What it changes in a run, measured: benchmarks/results/head_dtype.md."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from testbed.common import CPU_ENV
from testbed.ports import free_port
from utils import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_fp32_head_rounds_only_the_output_and_keeps_the_bf16_gradient():
    """Logits: the float32 product of the bf16 operands (no bf16 rounding of the result, which a bf16 head has: up to
    0.06 at |z| in [16, 32)); gradients: what a bf16 head gets from the same upstream gradient in bf16."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(97, 64) * 4).to(torch.bfloat16).requires_grad_()
    logits = models.Fp32Head.apply(hidden, weight)
    exact = hidden.detach().double() @ weight.detach().double().t()
    assert logits.dtype == torch.float32 and logits.shape == (3, 5, 97)
    assert (logits.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    bf16 = torch.nn.functional.linear(hidden.detach(), weight.detach())
    assert (bf16.double() - exact).abs().max() > 100 * (logits.double() - exact).abs().max()  # what it avoids
    upstream = torch.randn(3, 5, 97)
    logits.backward(upstream)
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    torch.nn.functional.linear(h, w).backward(upstream.to(torch.bfloat16))
    assert torch.equal(hidden.grad, h.grad) and torch.equal(weight.grad, w.grad)
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_the_fp32_head_goes_on_bf16_models_only_and_refuses_a_head_it_cannot_run(testbed):
    """--head-dtype float32 on bf16 weights: the head returns float32 logits (the testbed's head is tied to the
    embedding: the weight stays shared); on float32 weights, or with --head-dtype model, nothing changes; a head with
    a bias stops with one line."""
    for dtype, head_dtype, logits_dtype in (
        (torch.bfloat16, "float32", torch.float32),
        (torch.bfloat16, "model", torch.bfloat16),
        (torch.float32, "float32", torch.float32),
    ):
        args = SimpleNamespace(model_name_or_path=testbed.model_dir, attn_implementation="sdpa", zero_stage=2)
        model = models.load_model(SimpleNamespace(**vars(args), head_dtype=head_dtype), dtype, {})
        head = model.get_output_embeddings()
        assert head.weight is model.get_input_embeddings().weight
        assert head(torch.zeros(2, head.in_features, dtype=dtype)).dtype == logits_dtype, (dtype, head_dtype)
        assert (type(head) is models.Fp32Linear) == (dtype == torch.bfloat16 and head_dtype == "float32")
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with pytest.raises(SystemExit, match="--head-dtype float32 needs an output head .* pass --head-dtype model"):
        models.fp32_head(model)


ENGINE = """
import json, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from utils import vllm_engine
dist.init_process_group("gloo")
args = SimpleNamespace(model_name_or_path=sys.argv[1], head_dtype=sys.argv[2], dtype="bfloat16", seed=1,
    max_prompt_length=64, max_response_length=16, vllm_gpu_memory_utilization=0.5, vllm_kv_cache_memory=0.5,
    vllm_tensor_parallel_size=1, vllm_sleep_level=0)
llm = vllm_engine.start_engine(args, 0, False, None)
def logits(model):
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    return str(model.compute_logits(hidden).dtype), str(model.lm_head.weight.dtype)
print(json.dumps(llm.apply_model(logits)[0]))
vllm_engine.close_engine(llm)
"""


@pytest.mark.vllm
@pytest.mark.parametrize("head_dtype", ["float32", "model"])
def test_the_vllm_engine_computes_its_logits_in_the_head_dtype(testbed, head_dtype):
    """The real vLLM-CPU engine that start_engine builds (bf16 weights): its logits are float32 with --head-dtype
    float32, bf16 with model; its head's weight stays bf16 (vLLM casts in the product: logits_processor.py l. 174)."""
    env = {**os.environ, **CPU_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}
    env |= {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-c", ENGINE, testbed.model_dir, head_dtype]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits_dtype, weight_dtype = json.loads(proc.stdout.strip().splitlines()[-1])
    assert logits_dtype == ("torch.float32" if head_dtype == "float32" else "torch.bfloat16")
    assert weight_dtype == "torch.bfloat16"
