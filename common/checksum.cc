#include "common/checksum.h"

#include <xxhash.h>

#include "common/check.h"

namespace actstash {

struct Xxh3Hasher::State {
  XXH3_state_t* xxh = nullptr;
};

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) {
  state_->xxh = XXH3_createState();
  ACTSTASH_CHECK(state_->xxh != nullptr, "XXH3_createState failed (out of memory)");
  XXH3_64bits_reset(state_->xxh);
}

Xxh3Hasher::~Xxh3Hasher() {
  if (state_ != nullptr) XXH3_freeState(state_->xxh);
}

Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) XXH3_freeState(state_->xxh);
    state_ = std::move(other.state_);
  }
  return *this;
}

void Xxh3Hasher::Update(const void* data, size_t size) {
  if (size == 0) return;
  XXH3_64bits_update(state_->xxh, data, size);
}

uint64_t Xxh3Hasher::Digest() const { return XXH3_64bits_digest(state_->xxh); }

uint64_t Xxh3(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace actstash
