#!/usr/bin/env bash
# The wheels an offline GPU machine that already has PyTorch and transformers (and no vLLM) needs to run the scripts
# with --no-use-vllm and benchmarks/checks/gpu_smoke.py; README, "First GPU run". On a machine with network and pip:
#     bash benchmarks/checks/gpu_wheelhouse.sh DIR      # Linux x86_64, CPython 3.12 (PYTHON_VERSION=3.11 for another)
# then, on the GPU machine, from the repository root:
#     pip install --no-index --find-links DIR deepspeed==0.19.8 tyro==1.0.17 datasets==5.2.0 math-verify==0.9.0
# tests/test_wheelhouse.py checks, without network, that IMAGE + TOP + WHEELS hold every distribution the scripts,
# utils/ and the smoke test import on that path, and every requirement of TOP and WHEELS.
set -euo pipefail

# what the machine is assumed to have: the packages its image names (torch 2.11, transformers 5.17, accelerate 1.15,
# ...) and their own requirements
IMAGE=(torch transformers accelerate numpy pyarrow pandas safetensors tokenizers huggingface-hub rich tqdm matplotlib
  filelock typing-extensions setuptools sympy networkx jinja2 fsspec triton packaging pyyaml regex typer psutil
  python-dateutil tzdata markdown-it-py pygments hf-xet httpx click contourpy cycler fonttools kiwisolver pillow
  pyparsing)
# what the scripts need beyond it: requirements.txt's pins, then what those require beyond the image at the CPU stack's
# versions (the ones CI tests). DeepSpeed has no wheel on PyPI: built here from its source without compiled ops (it
# compiles an op when first used; the scripts use none: torch's AdamW, no DeepSpeed kernels)
TOP=(deepspeed==0.19.8 tyro==1.0.17 datasets==5.2.0 math-verify==0.9.0)
WHEELS=(docstring-parser==0.18.0 typeguard==4.6.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 einops==0.8.2 hjson==3.1.0 msgpack==1.2.4
  ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5)
# image packages that TOP and WHEELS bound (datasets: fsspec <= 2026.9.0, huggingface-hub >= 1.31; pydantic:
# typing-extensions >= 4.16): pip takes these only where the image's version is outside the bounds
BOUNDS=(fsspec==2026.9.0 huggingface-hub==1.33.0 typing-extensions==4.16.0)

dir=${1:?usage: bash benchmarks/checks/gpu_wheelhouse.sh DIR (PYTHON_VERSION=3.12 by default)}
py=${PYTHON_VERSION:-3.12}
pip=(python3 -m pip)
mkdir -p "$dir"
platforms=()
for tag in manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
  "${platforms[@]}" --dest "$dir" "${TOP[@]:1}" "${WHEELS[@]}" "${BOUNDS[@]}"
# pure Python: one wheel serves every CPython and platform; DS_BUILD_OPS=0: no op compiled now
DS_BUILD_OPS=0 "${pip[@]}" wheel --quiet --no-deps --wheel-dir "$dir" "${TOP[0]}"

echo "wheelhouse $dir (CPython $py, Linux x86_64):"
total=0
for f in "$dir"/*.whl; do
  size=$(wc -c < "$f")
  total=$((total + size))
  printf '%10d  %s\n' "$size" "$(basename "$f")"
done
echo "total: $(ls "$dir"/*.whl | wc -l) wheels, $(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1e6 }') MB"
echo "on the GPU machine: pip install --no-index --find-links $dir ${TOP[*]}"
