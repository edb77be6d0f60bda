// Happens-before edges for ThreadSanitizer, where the order between two
// threads is made by code it cannot see. Debian's gRPC is not instrumented:
// it runs a reactor's callbacks one at a time, each after the StartRead,
// StartWrite or Finish that asked for it, but on any of its threads, ordered
// by its own atomics. The reactors mark that order themselves:
// HappensBefore(this) just before asking gRPC for the next callback,
// HappensAfter(this) first thing in that callback. TSan then checks every
// access of the reactor's state against every other thread, and a missing
// edge still shows up as a race.
//
// Without TSan both are empty inline functions (no code at all), and
// CopyFromLibraryBuffer is a memcpy.
//
// Thread-safety: any thread; the address is only a key, never dereferenced.
#ifndef ACTSTASH_COMMON_HAPPENS_BEFORE_H_
#define ACTSTASH_COMMON_HAPPENS_BEFORE_H_

#if defined(__SANITIZE_THREAD__)
#define ACTSTASH_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ACTSTASH_THREAD_SANITIZER 1
#endif
#endif

#include <cstddef>
#include <cstring>

#ifdef ACTSTASH_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
// In the TSan runtime, not declared by every compiler's tsan_interface.h.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
extern "C" void __tsan_write_range(void* address, unsigned long size);  // NOLINT(runtime/int)
#endif

namespace actstash {

// Everything this thread did so far happens before what a thread does after
// a later HappensAfter(address).
inline void HappensBefore(const void* address) {
#ifdef ACTSTASH_THREAD_SANITIZER
  __tsan_release(const_cast<void*>(address));
#else
  (void)address;
#endif
}

// What this thread does next happens after everything done before the
// HappensBefore(address) calls that precede this one.
inline void HappensAfter(const void* address) {
#ifdef ACTSTASH_THREAD_SANITIZER
  __tsan_acquire(const_cast<void*>(address));
#else
  (void)address;
#endif
}

// memcpy(dst, src, n) where src is a buffer the uninstrumented libraries
// wrote and handed over through their own atomics (a message gRPC parsed on
// one of its threads): TSan checks the writes to dst as usual but not the
// reads of src. Checking them finds only such hand-offs (tsan.supp lists
// them), and each one costs TSan a suppressed report per racy word of the
// range: seconds for one 1 MiB chunk, long enough to stall a call past its
// deadline.
inline void CopyFromLibraryBuffer(void* dst, const void* src, size_t n) {
#ifdef ACTSTASH_THREAD_SANITIZER
  __tsan_ignore_thread_begin();
  std::memcpy(dst, src, n);
  __tsan_ignore_thread_end();
  __tsan_write_range(dst, n);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace actstash

#endif  // ACTSTASH_COMMON_HAPPENS_BEFORE_H_
