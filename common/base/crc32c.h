// CRC-32C (Castagnoli, reflected, as iSCSI and the KV wire use it): the fast host version, and
// the byte-at-a-time one the kernels that checksum device memory share with their reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/base/dtype.h"  // KVWIRE_HOST_DEVICE

namespace kvwire {

// CRC-32C of data[0, n), continuing from `crc` (the value over what came before; 0 to start).
// SSE4.2's instruction where the build has it.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The same function a bit at a time: no table, so a GPU thread runs it as it is. The
// specification of the checksum kernels (kernels::ChecksumSpans), not for long host buffers.
KVWIRE_HOST_DEVICE inline uint32_t Crc32cBitwise(const uint8_t* p, int64_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (int64_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

}  // namespace kvwire
