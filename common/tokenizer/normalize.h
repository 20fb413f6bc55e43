// Unicode normalization forms C and D (UAX #15), for the NFC / NFD normalizers: canonical
// decomposition (Hangul syllables by arithmetic, everything else from the decomposition table of
// unicode_tables.cc), canonical ordering of combining marks, and, for NFC, canonical
// composition. The other normalizers (Prepend, Replace, Strip) are simple enough to live in the
// encode pipeline (encode.cc).
#pragma once

#include <string>
#include <string_view>

namespace kvwire::tokenizer_internal {

// `s` (valid UTF-8) in NFC when `compose`, else in NFD.
std::string NormalizeUnicode(std::string_view s, bool compose);

}  // namespace kvwire::tokenizer_internal
