// How Abseil's Mutex runs in actstash's processes and libraries.
#ifndef ACTSTASH_COMMON_MUTEX_MODE_H_
#define ACTSTASH_COMMON_MUTEX_MODE_H_

namespace actstash {

// Turns off Abseil's run-time deadlock detection unless the environment asks
// for it (ACTSTASH_MUTEX_DEADLOCK_DETECTION=1) or actstash itself is a debug
// build (no NDEBUG). Abseil enables the detection in its own debug builds,
// and distributions build it so (Debian's libabsl): every Lock/Unlock pair
// then walks a process-wide graph of mutexes, about 1,000 instructions, which
// made up two thirds of the saved-tensor hot path for small tensors. Lock
// order is checked where it belongs: the compiler's thread-safety analysis
// and the ThreadSanitizer build. Idempotent and thread-safe; call it before
// the first Mutex of a daemon or a client is used (a Mutex locked while the
// detection was on is simply no longer tracked).
void ConfigureMutexes();

}  // namespace actstash

#endif  // ACTSTASH_COMMON_MUTEX_MODE_H_
