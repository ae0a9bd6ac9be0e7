// Faults injected for the tests (parallel.test_fault).
//
// "KIND:RANK": a failure at step 1 on that rank (die, hang, throw, mismatch: a collective
// the other ranks do not issue; slow_save acts in checkpoint_save instead).
// "KIND:RANK:S1,S2,...": at optimizer steps S1, S2, ... that rank injects a numerical
// fault, which travels through the real reductions to every rank:
//   overflow: scales its loss by a further 2^40, so that its fp16 gradients overflow;
//   spike:    multiplies its gradients by 1000 (a gradient-norm spike; the loss is unchanged);
//   nan:      makes its loss NaN (the gradients are unchanged).
#pragma once
#include <cstdint>
#include <string>

#include "comm/communicator.h"

namespace mt {

// Refuses a spec that is not one of the forms above (Config::validate, before any work).
void fault_spec_check(const std::string& spec);
// Whether numerical fault `kind` is injected at `step` on `rank`.
bool injected(const std::string& spec, const std::string& kind, int64_t step, int rank);
// The failures of the first form, at step 1.
void inject_fault(const std::string& spec, int64_t step, Communicator& world, Communicator& dp);

}  // namespace mt
