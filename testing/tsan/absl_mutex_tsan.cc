// ThreadSanitizer builds only (-DACTSTASH_SANITIZE=thread): tells TSan about
// the locks of the shared, uninstrumented Abseil that Debian ships.
//
// TSan sees only what instrumented code does and the pthread calls it
// intercepts. absl::Mutex is neither: its lock and unlock are atomics and
// futex calls inside libabsl_synchronization.so, so without this file every
// ABSL_GUARDED_BY member (and every lock of gRPC, which uses absl::Mutex)
// looks unsynchronized. This file defines the exported entry points of
// absl::Mutex, absl::CondVar (where a wait releases and retakes the mutex)
// and absl::Notification itself; each calls the library's own definition,
// found with dlsym(RTLD_NEXT), between the annotations of
// <sanitizer/tsan_interface.h>, as Abseil does when it is built with TSan.
// Linked into every executable of a TSan build (testing/tsan/CMakeLists.txt)
// and exported from it (absl_mutex_tsan.dynlist), these definitions come
// first in the dynamic lookup, so calls from the project, from gRPC and from
// Abseil itself (its internal calls go through the PLT) all arrive here.
//
// Between __tsan_mutex_pre_* and __tsan_mutex_post_* TSan ignores memory
// accesses: conditions (absl::Condition) that Abseil evaluates inside a lock,
// an unlock or an Await, possibly on another thread, are evaluated under the
// mutex but would otherwise look like unlocked reads.
//
// The symbol names are those of Abseil 20220623 (Debian 12); a missing one
// aborts at its first use, naming it. scripts/sanitize runs a self-test
// (absl_mutex_selftest.cc) before the suites.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#define ACTSTASH_TSAN_STR2(x) #x
#define ACTSTASH_TSAN_STR(x) ACTSTASH_TSAN_STR2(x)

namespace {

// The library's definition of absl::<suffix>, e.g. "5Mutex4LockEv": the
// mangled name after the prefix "_ZN4absl" and Abseil's inline namespace
// (substitutions inside the suffix are relative to that prefix). A const
// member function's suffix starts with "K" ("_ZNK4absl...").
void* RealSymbol(const char* suffix) {
  std::string name = "_ZN";
  if (*suffix == 'K') name += *suffix++;
  name += "4absl";
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const char* inline_namespace = ACTSTASH_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  name += std::to_string(std::strlen(inline_namespace)) + inline_namespace;
#endif
  name += suffix;
  void* symbol = dlsym(RTLD_NEXT, name.c_str());
  if (symbol == nullptr) {
    std::fprintf(stderr, "absl_mutex_tsan: %s not found in the shared Abseil: %s\n", name.c_str(),
                 dlerror());
    std::abort();
  }
  return symbol;
}

template <typename Fn>
Fn Real(const char* suffix) {
  return reinterpret_cast<Fn>(RealSymbol(suffix));
}

// absl/synchronization/mutex.cc: the bit of Mutex::mu_ set while a writer
// holds it. A wait releases the mutex in the mode it is held in.
constexpr intptr_t kMuWriter = 0x0008;

unsigned HeldMode(const std::atomic<intptr_t>& word) {
  return (word.load(std::memory_order_relaxed) & kMuWriter) != 0 ? 0 : __tsan_mutex_read_lock;
}

// A wait that gives the mutex up and has it again on return (Await,
// CondVar::Wait): a release and an acquire for TSan, the real wait between.
template <typename Call>
auto Locking(void* mu, unsigned mode, Call call) {
  __tsan_mutex_pre_lock(mu, mode);
  auto result = call();
  __tsan_mutex_post_lock(mu, mode, 0);
  return result;
}

template <typename Call>
auto ReleaseAndRetake(void* mu, unsigned mode, Call call) {
  __tsan_mutex_pre_unlock(mu, mode);
  __tsan_mutex_post_unlock(mu, mode);
  return Locking(mu, mode, call);
}

template <typename Call>
bool TryLocking(void* mu, unsigned mode, Call call) {
  __tsan_mutex_pre_lock(mu, mode | __tsan_mutex_try_lock);
  const bool locked = call();
  __tsan_mutex_post_lock(
      mu, mode | __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  return locked;
}

template <typename Call>
void Unlocking(void* mu, unsigned mode, Call call) {
  __tsan_mutex_pre_unlock(mu, mode);
  call();
  __tsan_mutex_post_unlock(mu, mode);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// The Locking/ReleaseAndRetake helpers return a value; void calls return 0.

Mutex::~Mutex() {
  static const auto real = Real<void (*)(Mutex*)>("5MutexD1Ev");
  // The inline constructor, compiled with TSan, created it with this flag.
  __tsan_mutex_destroy(this, __tsan_mutex_not_static);
  real(this);
}

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  Locking(this, 0, [&] { return real(this), 0; });
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  Locking(this, __tsan_mutex_read_lock, [&] { return real(this), 0; });
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  return TryLocking(this, 0, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  return TryLocking(this, __tsan_mutex_read_lock, [&] { return real(this); });
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  Unlocking(this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  Unlocking(this, __tsan_mutex_read_lock, [&] { real(this); });
}

// LockWhen*: the mutex is held on return, whatever the result. The library's
// *WithTimeout variants call its *WithDeadline ones through the PLT (here) on
// some paths only; here they are what it computes, deadline = now + timeout,
// so that each wait is annotated once.
void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  Locking(this, 0, [&] { return real(this, cond), 0; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Locking(this, __tsan_mutex_read_lock, [&] { return real(this, cond), 0; });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  return LockWhenWithDeadline(cond, absl::Now() + timeout);
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  return ReaderLockWhenWithDeadline(cond, absl::Now() + timeout);
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locking(this, 0, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locking(this, __tsan_mutex_read_lock, [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  ReleaseAndRetake(this, HeldMode(mu_), [&] { return real(this, cond), 0; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  return AwaitWithDeadline(cond, absl::Now() + timeout);
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return ReleaseAndRetake(this, HeldMode(mu_), [&] { return real(this, cond, deadline); });
}

// CondVar is a friend of Mutex (mu->mu_). Signal and SignalAll need nothing:
// the woken thread retakes the mutex, and that is what orders it.
void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  ReleaseAndRetake(mu, HeldMode(mu->mu_), [&] { return real(this, mu), 0; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  return WaitWithDeadline(mu, absl::Now() + timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return ReleaseAndRetake(mu, HeldMode(mu->mu_), [&] { return real(this, mu, deadline); });
}

// Notification: WaitForNotification returns without locking once the flag is
// set (an atomic inside the library), and HasBeenNotified (inline, so
// instrumented) is an acquire load of that flag: Notify releases on the
// flag's address, and a wait that saw it set acquires from there.
void Notification::Notify() {
  static const auto real = Real<void (*)(Notification*)>("12Notification6NotifyEv");
  __tsan_release(&notified_yet_);
  real(this);
}

void Notification::WaitForNotification() const {
  static const auto real =
      Real<void (*)(const Notification*)>("K12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(const_cast<std::atomic<bool>*>(&notified_yet_));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  static const auto real = Real<bool (*)(const Notification*, absl::Duration)>(
      "K12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<std::atomic<bool>*>(&notified_yet_));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static const auto real = Real<bool (*)(const Notification*, absl::Time)>(
      "K12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<std::atomic<bool>*>(&notified_yet_));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
