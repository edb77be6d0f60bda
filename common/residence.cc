// The transition table of common/residence.h.
#include "common/residence.h"

namespace actstash {

std::optional<Residence> NextResidence(Residence state, ResidenceEvent event) {
  using S = Residence;
  switch (event) {
    case ResidenceEvent::kSpill:
      if (state == S::kResident) return S::kSpilling;
      return std::nullopt;
    case ResidenceEvent::kSpillDone:
      if (state == S::kSpilling) return S::kSpilled;
      return std::nullopt;
    case ResidenceEvent::kSpillFailed:
      if (state == S::kSpilling) return S::kResident;
      return std::nullopt;
    case ResidenceEvent::kRestore:
      if (state == S::kSpilled) return S::kRestoring;
      return std::nullopt;
    case ResidenceEvent::kRestoreDone:
      if (state == S::kRestoring) return S::kResident;
      return std::nullopt;
    case ResidenceEvent::kRestoreFailed:
      if (state == S::kRestoring) return S::kSpilled;
      return std::nullopt;
    case ResidenceEvent::kSpillGone:
      if (state == S::kRestoring) return S::kLost;
      return std::nullopt;
  }
  return std::nullopt;
}

const char* ResidenceName(Residence state) {
  switch (state) {
    case Residence::kResident:
      return "resident";
    case Residence::kSpilling:
      return "spilling";
    case Residence::kSpilled:
      return "spilled";
    case Residence::kRestoring:
      return "restoring";
    case Residence::kLost:
      return "lost";
  }
  return "?";
}

const char* ResidenceEventName(ResidenceEvent event) {
  switch (event) {
    case ResidenceEvent::kSpill:
      return "spill";
    case ResidenceEvent::kSpillDone:
      return "spill done";
    case ResidenceEvent::kSpillFailed:
      return "spill failed";
    case ResidenceEvent::kRestore:
      return "restore";
    case ResidenceEvent::kRestoreDone:
      return "restore done";
    case ResidenceEvent::kRestoreFailed:
      return "restore failed";
    case ResidenceEvent::kSpillGone:
      return "spill gone";
  }
  return "?";
}

}  // namespace actstash
