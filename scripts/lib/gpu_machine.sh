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
# The step benchmark's peers that the machines lack, carried as wheels by the
# kit (scripts/gpu-kit --peers) and installed there without dependencies:
# torchtune's OffloadActivations (torchtune 0.6.1 needs torchao's NF4Tensor,
# which torchao 0.13 still has; 0.14 and later dropped it, 0.12 does not
# import on torch 2.11).
GPU_MACHINE_PEERS="torchtune==0.6.1 torchao==0.13.0"
