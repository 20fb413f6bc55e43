#pragma once

#include "kernels/backend.h"

namespace kvwire::kernels {

// The naive reference backend (see reference.cc): the specification of every op.
KernelBackendPtr MakeReferenceBackend();

}  // namespace kvwire::kernels
