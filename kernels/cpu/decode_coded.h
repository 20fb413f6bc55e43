// Decode attention over a coded cache (KvCoding) on the CPU: one cache head and its group of
// query heads, dequantising each row as it is read.
#pragma once

#include "kernels/backend.h"

namespace kvwire::kernels::cpu {

// Cache head c of `seq` for its `group` query heads; s holds group · (tokens attended) floats.
void DecodeHeadCoded(const DecodeSequence& seq, int c, int group, int head_dim, DType dtype,
                     float scale, float* s);

}  // namespace kvwire::kernels::cpu
