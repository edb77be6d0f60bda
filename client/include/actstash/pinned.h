// PinPolicy: when actstash registers host memory with CUDA (page-locked for
// the GPU's copy engines). Shared by the client's options and the daemon.
#ifndef ACTSTASH_PINNED_H_
#define ACTSTASH_PINNED_H_

namespace actstash {

enum class PinPolicy {
  kAuto,  // when a CUDA device is present; a failure falls back to unpinned
  kOn,    // always; a failure is an error (no device: an error too)
  kOff,   // never
};

}  // namespace actstash

#endif  // ACTSTASH_PINNED_H_
