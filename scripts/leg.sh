# Sourced by setup_leg.sh and test_leg.sh: what one test leg is.
#   leg_config modern|dota|codebases   sets venv, py_minor, the pins, and requires: the
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
    codebases)
        # The third leg: the OpenMMLab codebases whose trainers are not
        # detectors (mmpretrain, mmpose, mmagic; issue 66). They import
        # torchvision, and no torchvision on the registry loads beside the
        # CPU torch 2.13 of the modern leg (every wheel links
        # libtorch_cuda.so; PyPI has no torchvision source since 0.1.6, so
        # a build as mmcv's is impossible offline). The pair that lies on
        # this machine's disk, torch 2.14.1 + torchvision 0.29.1 (a CUDA
        # build), loads and runs on the CPU: docs/compatibility.md.
        venv=.venv-codebases
        py_minor=3.11
        torch_pin=torch==2.14.1
        mmengine_pin=mmengine==0.10.7
        mmcv_version=2.1.0                # mmpose 1.3.2 asks mmcv < 2.2, as mmdet 3.3
        # numpy 1.26: mmagic 1.2.0 uses np.bool8, which numpy 2 removed; the
        # newest opencv-python and pandas that take it. imageio, pandas,
        # resize-right, lpips: what `import mmagic.models` imports of
        # mmagic's requirements. mmagic's diffusers/transformers: the
        # newest that still import on its code (docs/compatibility.md).
        # scikit-image, scikit-learn: albumentations' (below).
        extra_pins=(torchvision==0.29.1 numpy==1.26.4 xtcocotools==1.14.3 json-tricks==3.17.3
                    munkres==3.0.0 einops==0.8.2 mat4py==0.6.0 model-index==0.1.11 rich==15.0.0
                    matplotlib==3.11.2 scipy==1.17.1 diffusers==0.24.0 huggingface-hub==0.19.4
                    transformers==4.36.2 tokenizers==0.15.2 mmdet==3.3.0
                    opencv-python==4.11.0.86 imageio==2.38.2 pandas==2.2.3 resize-right==0.0.2
                    lpips==0.1.4 scikit-image==0.26.0 scikit-learn==1.9.1 PyYAML==6.0.4)
        # Their own requirements list what training does not import and
        # will not build here (mmpose's chumpy; mmagic's mediapipe, av,
        # face-alignment, ...): the packages alone. RTMPose's Albumentation
        # step and mmagic.datasets.transforms import albumentations (not
        # among mmagic's requirements): 1.3.1 and its qudida without their
        # opencv-python-headless (a second cv2), as in the DOTA leg.
        nodeps_pins=(mmpretrain==1.2.0 mmpose==1.3.2 mmagic==1.2.0
                     albumentations==1.3.1 qudida==0.0.4)
        test_pins=(pytest pytest-timeout==2.4.0 setuptools==80.10.2)
        requires=mmpretrain,mmpose,mmagic
        # Only the tests of its packages (tests/conftest.py): the rest of
        # the suite is the other legs'.
        only=$requires
        ;;
    *) echo "unknown leg $1 (modern|dota|codebases)" >&2; return 2 ;;
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
