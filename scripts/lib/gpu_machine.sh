# shellcheck shell=bash
# The Python environment of the GPU machines this project is measured on, in
# one place: the GPU kit's libtorch adapter is built against this torch
# (scripts/gpu-kit), the kit's check runs it (scripts/check-gpu-kit), and CI's
# first pip lane tests it (scripts/test-pip-torch gpu). Sourced, not run.
#
#   GPU_MACHINE_PYTHON  the machines' Python (the kit's Python phases use theirs)
#   GPU_MACHINE_TORCH   torch from PyPI (the +cu130 build is PyPI's default)
#   GPU_MACHINE_WITH    what else the machines have, pinned for pip
GPU_MACHINE_PYTHON=3.12
GPU_MACHINE_TORCH=2.11.0
GPU_MACHINE_WITH="transformers==5.17.* accelerate==1.15.*"
