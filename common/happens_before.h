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
// Without TSan both are empty inline functions (no code at all).
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

#ifdef ACTSTASH_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
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

}  // namespace actstash

#endif  // ACTSTASH_COMMON_HAPPENS_BEFORE_H_
