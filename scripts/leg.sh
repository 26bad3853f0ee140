# Sourced by setup_leg.sh and test_leg.sh: what one test leg is.
#   leg_config modern|dota   sets venv, py_minor, the pins, and requires: the
#   test markers (tests/conftest.py) whose packages the leg installs by design,
#   so that in this leg their import failing is an error, never a skip.
# MMNANHOOK_REQUIRE_ALL_LEGS=1 (.ci/run sets it): a leg whose Python is
# missing fails instead of being skipped.
leg_config() {
    case $1 in
    modern)
        venv=.venv
        py_minor=3.11
        torch_pin=torch==2.13.0           # the CPU build that lies on this machine's disk
        mmengine_pin=mmengine==0.10.7
        mmcv_version=2.1.0                # newest mmcv mmdet 3.3 accepts (<2.2); compiles with C++17
        # mmseg imports ftfy and regex unconditionally (its tokenizer). mmpretrain
        # cannot be installed in either leg (see tests/conftest.py).
        extra_pins=(mmdet==3.3.0 mmsegmentation==1.2.2 ftfy==6.3.1 regex==2026.11.19)
        # setuptools < 82 keeps pkg_resources, which mmengine 0.10.7 needs for
        # every `package::` config (tests/test_docs.py loads the README's);
        # torch 2.13 asks for >= 77.0.3. docs/configuration.md tells users so.
        # pytest-timeout: a test that hangs fails with every thread's stack
        # (pytest.ini's timeout).
        test_pins=(pytest pytest-timeout==2.4.0 tensorboard==2.21.0 setuptools==80.10.2)
        nodeps_pins=()
        requires=mmdet,mmseg
        ;;
    dota)
        # shellcheck disable=SC1091
        . docker/versions.env
        venv=.venv-dota
        py_minor=$PYTHON_VERSION
        torch_pin=torch==$TORCH_VERSION   # PyPI wheel (CUDA 10.2 build), runs on CPU
        mmengine_pin=mmengine==$MMENGINE_VERSION
        mmcv_version=$MMCV_VERSION
        # numpy pinned (1.23.x): e2cnn, an mmrotate 1.0.0rc1 dependency, still uses the
        # np.float alias that numpy 1.24 removed.
        extra_pins=("torchvision==$TORCHVISION_VERSION" "numpy==$NUMPY_VERSION" "pillow==$PILLOW_VERSION"
                    "mmdet==$MMDET_VERSION" "mmrotate==$MMROTATE_VERSION"
                    mmyolo==0.6.0 prettytable==3.11.0 scikit-image==0.21.0 scikit-learn==1.3.2)
        # mmyolo 0.6.0 asserts mmcv < 2.1: this leg's (issue 53). Its YOLOv5
        # pipeline's Albu step needs albumentations 1.3.x, whose requirement
        # opencv-python-headless (also qudida's) would install a second cv2
        # beside mmcv's opencv-python: installed without their requirements
        # (their others are in extra_pins).
        nodeps_pins=(albumentations==1.3.1 qudida==0.0.4)
        # The newest tensorboard for Python 3.8 (tests read event files back).
        test_pins=(pytest pytest-timeout==2.4.0 tensorboard==2.14.0)
        requires=mmdet,mmrotate,mmyolo
        ;;
    *) echo "unknown leg $1 (modern|dota)" >&2; return 2 ;;
    esac
}

# missing_leg LEG WHAT: a leg that cannot run here.  Loud, and fatal where
# every leg is required.
missing_leg() {
    if [ "${MMNANHOOK_REQUIRE_ALL_LEGS:-0}" = 1 ]; then
        echo "[$1] ERROR: $2, and MMNANHOOK_REQUIRE_ALL_LEGS=1 requires every leg" >&2
        exit 1
    fi
    echo "################################################################################"
    echo "[$1] SKIPPED: $2: the DOTA leg (torch 1.7, mmrotate) does NOT run here"
    echo "################################################################################"
    exit 0
}

# find_python MAJOR.MINOR: a Python of that version (pyenv, else PATH).
find_python() {
    local v=$1 p
    if command -v pyenv >/dev/null 2>&1; then
        for p in $(pyenv versions --bare 2>/dev/null | grep -E "^$v(\.[0-9]+)?$" | sort -V -r); do
            if [ -x "$(pyenv prefix "$p")/bin/python" ]; then
                echo "$(pyenv prefix "$p")/bin/python"; return 0
            fi
        done
    fi
    command -v "python$v" 2>/dev/null || return 1
}
