# Make a GPU machine (no network) ready to run llamarl and the bench/ scripts. From the repo root:
#
#     source bench/gpu_env.sh && python bench/e2e.py
#
# The machine has Python 3.12, torch, transformers, accelerate, pyarrow, pandas, … but not what
# travels as wheels in .whl/ (git-ignored: the device tool needs `carry: [".whl"]`), for cp312
# manylinux x86_64: megatron-core 0.16.1, submitit, pydantic (+ pydantic-core, annotated-types,
# typing-inspection, typing-extensions ≥ 4.16), matplotlib (+ contourpy, cycler, fonttools,
# kiwisolver, pillow, pyparsing: pipeline/metrics.py plots after every ppo), wheel (for an old
# setuptools), and for bench/e2e.py trl 1.16 with datasets (+ dill, multiprocess).
# Everything goes into /tmp/site, first on PYTHONPATH, so the machine's own site-packages stay as
# they are: the wheels (skipped when /tmp/site already has this exact set), then llamarl itself,
# built from a copy of the working tree (non-editable, no build isolation, no network).
# Bytecode: the machine runs with PYTHONDONTWRITEBYTECODE=1 and its packages ship without .pyc
# files, so every process compiled every module it imported from source (`import torch` 4.9 s,
# transformers + AutoTokenizer 14-17 s). A pip install compiles them once, as this script now does
# for /tmp/site and the machine's own site-packages (once a machine; the seconds are printed):
# start-up numbers are those of an ordinary installation.
# Sourced, so it never exits the caller's shell: it returns 1 on failure.

_llamarl_gpu_env() {
    local site=/tmp/site pip_env="PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1"
    if [ ! -f pyproject.toml ] || [ ! -d lib ] || [ ! -d stages ]; then
        echo "gpu_env.sh: source it from the llamarl repo root (no pyproject.toml, lib/, stages/ here)" >&2
        return 1
    fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_env.sh: no wheels in .whl/ (pass carry: [\".whl\"] to the device tool)" >&2
        return 1
    fi
    mkdir -p "$site" || return 1
    local stamp
    stamp=$(stat -c '%n %s' .whl/*.whl | md5sum | cut -c1-32)
    if [ "$(cat "$site/.whl-stamp" 2>/dev/null)" != "$stamp" ]; then
        env $pip_env python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || { echo "gpu_env.sh: installing .whl/*.whl failed" >&2; return 1; }
        echo "$stamp" > "$site/.whl-stamp"
    fi
    # Build from a copy: setuptools builds in the source tree, and a build/ left there by an earlier
    # call would be reused (it copies only files newer than its own), installing stale modules.
    local src
    src=$(mktemp -d /tmp/llamarl-src.XXXXXX) || return 1
    cp -r pyproject.toml README.md llamarl lib stages pipeline cluster "$src"/ || { rm -rf "$src"; return 1; }
    # PYTHONPATH: the build may need `wheel` from .whl/ (setuptools < 70.1 has no bdist_wheel of its own).
    env $pip_env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation --no-cache-dir --upgrade --target "$site" "$src" >/dev/null
    local rc=$?
    rm -rf "$src"
    [ $rc -eq 0 ] || { echo "gpu_env.sh: installing llamarl from the working tree failed" >&2; return 1; }
    if [ ! -f /tmp/.llamarl-bytecode ]; then
        local t0=$SECONDS dirs
        dirs=$(python3 -c "import site; print(' '.join(site.getsitepackages()))")
        # shellcheck disable=SC2086  # several directories
        python3 -m compileall -q -j 0 -x '/tests?/' $dirs "$site" >/dev/null 2>&1
        touch /tmp/.llamarl-bytecode
        echo "gpu_env: bytecode compiled for $dirs and $site in $((SECONDS - t0)) s"
    fi
    return 0
}

_llamarl_rc=1
if _llamarl_gpu_env; then
    case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
    case ":$PATH:" in *:/tmp/site/bin:*) ;; *) export PATH=/tmp/site/bin:$PATH ;; esac
    # The repo root holds a llamarl/ folder (just __init__.py): with the current directory first on
    # sys.path (`python -m …`, which is how stages start, and `python -c`), it would hide the
    # installed package and `import llamarl.lib` would fail. Python ≥ 3.11 leaves it out with this.
    export PYTHONSAFEPATH=1
    # NVLink multicast (NVLS) stays off on these machines.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -c "
import torch
n = torch.cuda.device_count()
print(f'gpu_env: torch {torch.__version__}, {torch.cuda.get_device_name(0) if n else \"no GPU\"} x {n}, '
      f'llamarl from /tmp/site', flush=True)" && _llamarl_rc=0
fi
unset -f _llamarl_gpu_env
test "$_llamarl_rc" -eq 0 && unset _llamarl_rc  # the status of `source`: 0 when ready
