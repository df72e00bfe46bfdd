# GPU image for ga-train. Build:  docker build -t gacli .
# Run:    mkdir -p runs && docker run --gpus all --user "$(id -u):$(id -g)" -v "$PWD/runs:/runs" gacli config=unet.yaml accum_steps=8
# The base is the official TensorFlow GPU image (CUDA and cuDNN included). Any image whose
# python3 has TensorFlow 2.21 and pip works as well: --build-arg TF_IMAGE=...
ARG TF_IMAGE=tensorflow/tensorflow:2.21.0-gpu
FROM ${TF_IMAGE}

# TF_FORCE_GPU_ALLOW_GROWTH: TensorFlow otherwise reserves almost all of every visible GPU's
# memory at start, which hides what a run really needs and blocks a second job on the same GPU.
# HOME is set because a --user uid that the image does not know has no home of its own (Docker
# then uses /, Podman the working directory, where Keras would leave its .keras/ in the run).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_FORCE_GPU_ALLOW_GROWTH=true \
    VIRTUAL_ENV=/opt/gacli/venv \
    PATH=/opt/gacli/venv/bin:$PATH \
    HOME=/home/gacli

WORKDIR /opt/gacli/src
COPY pyproject.toml README.md ./
COPY gacli ./gacli
COPY configs ./configs
COPY recipes ./recipes
# A venv that sees the base's packages: the base's TensorFlow (built for its CUDA) satisfies the
# requirement and is not downloaded again, and pip never writes into a system Python that may be
# marked externally managed (PEP 668, Ubuntu 24.04 and Debian 12 bases). --without-pip because
# some bases lack ensurepip; the base's own pip, run by the venv's interpreter, installs into it.
# The user gets a fixed uid of its own: uid 1000 is already taken on some bases (Ubuntu 24.04).
# /runs and the home are world-writable (sticky, as /tmp) so that any --user can write there.
RUN useradd --no-log-init --create-home --uid 10001 --user-group gacli \
    && python3 -m venv --without-pip --system-site-packages "$VIRTUAL_ENV" \
    && "$VIRTUAL_ENV/bin/python" -m pip install --no-cache-dir . \
    && mkdir -p /runs \
    && chown gacli:gacli /runs \
    && chmod 1777 /runs /home/gacli

USER 10001:10001
# Runs write outputs/ and multirun/ under the working directory: mount a volume here.
WORKDIR /runs
VOLUME ["/runs"]
ENTRYPOINT ["ga-train"]
