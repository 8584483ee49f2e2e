#!/usr/bin/env bash
# Download into .whl/ the wheels a GPU machine (Python 3.12, no network) lacks; bench/gpu_env.sh
# installs them there. .whl/ is git-ignored: run this once per checkout, on a machine with PyPI.
#
#     bash bench/fetch_wheels.sh && ls .whl
#
# --no-deps on purpose: the GPU image already has torch, transformers, numpy, pyarrow, …; only what
# it lacks travels (about 30 MB), each pinned where a version matters.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pip=${PIP:-python3 -m pip}
$pip download -q --dest .whl --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp --abi cp312 \
    "megatron-core==0.16.1" submitit cloudpickle \
    "pydantic>=2.7" pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" \
    typer rich click shellingham markdown-it-py mdurl pygments \
    matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing \
    wheel xxhash "trl==1.16.*" datasets dill multiprocess psutil
# pydantic pins pydantic-core exactly: check the pair (unzip -p .whl/pydantic-*.whl "*/METADATA" | grep core).
ls .whl | grep -c . | xargs echo "fetch_wheels: wheels in .whl:"
