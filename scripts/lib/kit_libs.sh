# The shared libraries a GPU kit never carries, as extended regular
# expressions over a library's file name (one fact for scripts/gpu-kit, which
# leaves them out, and scripts/check-gpu-kit, which lets the kit's binaries
# load them from the bare system it runs in). Sourced, not run.
#
#   KIT_SYSTEM_LIBS  the C and C++ runtimes every Linux system has
#   KIT_DRIVER_LIBS  the GPU driver's, which come with the GPU machine's driver
#                    (absent where there is no GPU: the check's chroot)
KIT_SYSTEM_LIBS='linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s'
KIT_DRIVER_LIBS='libcuda|libnvidia-'
