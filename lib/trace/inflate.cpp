// DEFLATE/gzip codec. See inflate.hpp for the contract.
#include "trace/inflate.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <queue>
#include <vector>

namespace expseg::trace {
namespace {

// ---------------------------------------------------------------------------------------------
// CRC-32, slicing-by-8 (a byte-wise table would cap gunzip well below the decoder's own speed).

constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t i = 0; i < 256; ++i)
    for (std::size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  return t;
}
constexpr auto kCrc = make_crc_tables();

inline std::uint32_t load_le32(const unsigned char* p) noexcept {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
}
inline std::uint64_t load_le64(const unsigned char* p) noexcept {
  return std::uint64_t(load_le32(p)) | std::uint64_t(load_le32(p + 4)) << 32;
}
inline unsigned load_le16(const unsigned char* p) noexcept { return unsigned(p[0]) | unsigned(p[1]) << 8; }

std::string hex32(std::uint32_t v) {
  char b[11] = "0x";
  for (int i = 0; i < 8; ++i) b[2 + i] = "0123456789abcdef"[(v >> (28 - 4 * i)) & 0xFu];
  return std::string(b, 10);
}

// ---------------------------------------------------------------------------------------------
// DEFLATE constants (RFC 1951 3.2.5).

constexpr std::array<std::uint16_t, 29> kLenBase = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                                    31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
constexpr std::array<std::uint8_t, 29> kLenExtra = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                                    2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
constexpr std::array<std::uint16_t, 30> kDistBase = {1,   2,   3,   4,   5,   7,    9,    13,   17,   25,
                                                     33,  49,  65,  97,  129, 193,  257,  385,  513,  769,
                                                     1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
constexpr std::array<std::uint8_t, 30> kDistExtra = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                                     6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};
constexpr std::array<std::uint8_t, 19> kClOrder = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};

// ---------------------------------------------------------------------------------------------
// Decoding tables. An entry is one uint32:
//   bits 0-3   code length to consume (whole code, also in subtables)
//   bits 4-7   kind
//   bits 8-12  extra bits (lengths/distances) or subtable index bits (links)
//   bits 16-31 value: literal/symbol, base, or subtable offset
// Codes of at most `primary` bits resolve in one lookup; longer ones go through one subtable of
// (max length - primary) bits indexed by the following bits.
enum Kind : std::uint32_t { k_literal = 0, k_base = 1, k_eob = 2, k_link = 3, k_invalid = 4 };

constexpr std::uint32_t entry(Kind kind, std::uint32_t value, std::uint32_t extra = 0, std::uint32_t len = 0) {
  return len | (std::uint32_t(kind) << 4) | (extra << 8) | (value << 16);
}
inline unsigned e_len(std::uint32_t e) { return e & 0xFu; }
inline unsigned e_kind(std::uint32_t e) { return (e >> 4) & 0xFu; }
inline unsigned e_extra(std::uint32_t e) { return (e >> 8) & 0x1Fu; }
inline unsigned e_value(std::uint32_t e) { return e >> 16; }

constexpr std::uint32_t kInvalid = entry(k_invalid, 0);

constexpr unsigned kLitPrimary = 10;
constexpr unsigned kDistPrimary = 8;
constexpr unsigned kClPrimary = 7;

// Primary table + at most one (1 << (MaxLen - Primary))-entry subtable per long code.
template <unsigned Primary, std::size_t Symbols, unsigned MaxLen = 15>
struct HuffTable {
  static constexpr std::size_t kSize =
      (std::size_t(1) << Primary) + (MaxLen > Primary ? Symbols * (std::size_t(1) << (MaxLen - Primary)) : 0);
  std::array<std::uint32_t, kSize> e;  // filled by build_table before any lookup
};
using LitTable = HuffTable<kLitPrimary, 288>;
using DistTable = HuffTable<kDistPrimary, 32>;
using ClTable = HuffTable<kClPrimary, 19, 7>;

// What each symbol decodes to, before the code length is filled in.
constexpr std::array<std::uint32_t, 288> make_lit_symbols() {
  std::array<std::uint32_t, 288> s{};
  for (std::uint32_t i = 0; i < 256; ++i) s[i] = entry(k_literal, i);
  s[256] = entry(k_eob, 0);
  for (std::uint32_t i = 0; i < 29; ++i) s[257 + i] = entry(k_base, kLenBase[i], kLenExtra[i]);
  s[286] = s[287] = kInvalid;  // only reachable with the fixed code
  return s;
}
constexpr std::array<std::uint32_t, 32> make_dist_symbols() {
  std::array<std::uint32_t, 32> s{};
  for (std::uint32_t i = 0; i < 30; ++i) s[i] = entry(k_base, kDistBase[i], kDistExtra[i]);
  s[30] = s[31] = kInvalid;
  return s;
}
constexpr std::array<std::uint32_t, 19> make_cl_symbols() {
  std::array<std::uint32_t, 19> s{};
  for (std::uint32_t i = 0; i < 19; ++i) s[i] = entry(k_literal, i);
  return s;
}
constexpr auto kLitSymbols = make_lit_symbols();
constexpr auto kDistSymbols = make_dist_symbols();
constexpr auto kClSymbols = make_cl_symbols();

inline std::uint32_t reverse_bits(std::uint32_t code, unsigned len) {
  std::uint32_t r = 0;
  for (unsigned i = 0; i < len; ++i, code >>= 1) r = (r << 1) | (code & 1u);
  return r;
}

enum class BuildResult { ok, empty, oversubscribed, incomplete };

// Builds a canonical-code lookup table. `allow_single` accepts the one incomplete code RFC 1951
// permits in practice (a single code of length 1), as zlib does.
template <unsigned Primary, std::size_t Symbols, unsigned MaxLen>
BuildResult build_table(HuffTable<Primary, Symbols, MaxLen>& t, const std::uint8_t* lens, std::size_t n,
                        const std::uint32_t* symbols, bool allow_single) {
  std::array<unsigned, 16> count{};
  for (std::size_t i = 0; i < n; ++i) ++count[lens[i]];
  count[0] = 0;
  unsigned max_len = 0, total = 0;
  for (unsigned l = 1; l <= 15; ++l)
    if (count[l]) max_len = l, total += count[l];

  constexpr std::size_t primary_size = std::size_t(1) << Primary;
  std::fill_n(t.e.begin(), primary_size, kInvalid);
  if (total == 0) return BuildResult::empty;

  int left = 1;
  for (unsigned l = 1; l <= 15; ++l) {
    left = left * 2 - int(count[l]);
    if (left < 0) return BuildResult::oversubscribed;
  }
  if (left > 0 && !(allow_single && total == 1 && count[1] == 1)) return BuildResult::incomplete;

  std::array<std::uint32_t, 16> next{};
  for (unsigned l = 1, code = 0; l <= 15; ++l) {
    code = (code + count[l - 1]) << 1;
    next[l] = code;
  }
  const unsigned sub_bits = max_len > Primary ? max_len - Primary : 0;
  std::size_t sub_next = primary_size;
  // Canonical order is by (length, symbol); iterating symbols per length gives it directly.
  for (unsigned l = 1; l <= max_len; ++l) {
    if (!count[l]) continue;
    for (std::size_t s = 0; s < n; ++s) {
      if (lens[s] != l) continue;
      const std::uint32_t r = reverse_bits(next[l]++, l);
      const std::uint32_t e = symbols[s] | l;
      if (l <= Primary) {
        for (std::size_t i = r; i < primary_size; i += std::size_t(1) << l) t.e[i] = e;
      } else {
        const std::size_t prefix = r & (primary_size - 1);
        if (e_kind(t.e[prefix]) != k_link) {
          std::fill_n(t.e.begin() + std::ptrdiff_t(sub_next), std::size_t(1) << sub_bits, kInvalid);
          t.e[prefix] = entry(k_link, std::uint32_t(sub_next), sub_bits);
          sub_next += std::size_t(1) << sub_bits;
        }
        const std::size_t base = e_value(t.e[prefix]);
        for (std::size_t i = r >> Primary; i < (std::size_t(1) << sub_bits); i += std::size_t(1) << (l - Primary))
          t.e[base + i] = e;
      }
    }
  }
  return BuildResult::ok;
}

struct FixedTables {
  LitTable lit;
  DistTable dist;
  FixedTables() {
    std::array<std::uint8_t, 288> l{};
    std::fill(l.begin(), l.begin() + 144, std::uint8_t(8));
    std::fill(l.begin() + 144, l.begin() + 256, std::uint8_t(9));
    std::fill(l.begin() + 256, l.begin() + 280, std::uint8_t(7));
    std::fill(l.begin() + 280, l.end(), std::uint8_t(8));
    build_table(lit, l.data(), 288, kLitSymbols.data(), false);
    std::array<std::uint8_t, 32> d{};
    d.fill(5);
    build_table(dist, d.data(), 32, kDistSymbols.data(), false);
  }
};
const FixedTables& fixed_tables() {
  static const FixedTables t;
  return t;
}

// ---------------------------------------------------------------------------------------------
// Decoder: appends one DEFLATE stream to `out`; back-references may not reach before `window_start`
// (the start of this gzip member).

class Inflater {
 public:
  // With a sink, output is handed on in pieces as it grows past kFlushBytes (and the rest at the
  // end): `out` then holds at most kFlushBytes plus the 32 KiB window back-references may reach.
  Inflater(std::string_view in, std::string& out, std::size_t base_offset, const ChunkSink* sink = nullptr)
      : start_(reinterpret_cast<const unsigned char*>(in.data())),
        p_(start_),
        end_(start_ + in.size()),
        base_offset_(base_offset),
        out_(out),
        sink_(sink) {}

  // Returns the input bytes consumed.
  std::size_t run() {
    window_start_ = out_.size();
    pos_ = emitted_ = out_.size();
    o_ = out_.data();
    cap_ = out_.size();
    bool final_block = false;
    try {
      while (!final_block) {
        final_block = bits(1) != 0;
        const unsigned type = bits(2);
        if (type == 0) {
          stored();
        } else if (type == 1) {
          const auto& f = fixed_tables();
          codes(f.lit, f.dist);
        } else if (type == 2) {
          dynamic();
        } else {
          fail("invalid block type 3 (reserved)");
        }
      }
      align_and_rewind();
    } catch (...) {
      out_.resize(pos_);
      // Cut short: what was decoded from real input is handed on, so a reader can say how far it got.
      if (sink_ && truncated_ && decoded_before_end() > handed_)
        (*sink_)(std::string_view(out_).substr(emitted_, decoded_before_end() - handed_));
      throw;
    }
    out_.resize(pos_);
    if (sink_) {
      (*sink_)(std::string_view(out_).substr(emitted_));
      out_.clear();
    }
    return std::size_t(p_ - start_);
  }

  // Bytes this stream decoded (with a sink: handed on or still held).
  std::size_t decoded() const { return handed_ + (pos_ - emitted_); }
  // Of them, those decoded before the input ran out (the decoder reads ahead into zero padding, so
  // a few symbols past that point may be garbage; those decoded from the last few real bytes are
  // left out too).
  std::size_t decoded_before_end() const { return padded_ ? decoded_at_end_ : decoded(); }

 private:
  const unsigned char* start_;
  const unsigned char* p_;
  const unsigned char* end_;
  std::size_t base_offset_;
  std::string& out_;
  const ChunkSink* sink_;
  std::size_t emitted_ = 0;  // with a sink: out_[0, emitted_) has been handed on
  std::size_t handed_ = 0;   // bytes handed to the sink
  bool padded_ = false;      // the input ran out and zeros were padded on
  std::size_t decoded_at_end_ = 0;  // decoded() when that happened
  bool truncated_ = false;
  std::uint64_t buf_ = 0;
  unsigned cnt_ = 0;    // bits in buf_
  std::size_t pad_ = 0; // zero bytes appended past the end of input (over-reads are detected later)
  std::size_t window_start_ = 0;
  std::size_t pos_ = 0;   // bytes of out_ in use
  char* o_ = nullptr;     // out_.data()
  std::size_t cap_ = 0;   // out_.size()
  LitTable lit_;
  DistTable dist_;
  ClTable cl_;

  // Offset of the first input byte not yet fully consumed (whole bytes still buffered are not).
  std::size_t input_offset() const {
    const std::size_t buffered = cnt_ / 8 > pad_ ? cnt_ / 8 - pad_ : 0;
    return base_offset_ + std::size_t(p_ - start_) - buffered;
  }

  [[noreturn]] void truncated() {
    truncated_ = true;
    throw gzip_error("truncated gzip data: the compressed stream ends before its final block");
  }
  // Corrupt-data errors; when the decoder has already read past the end, the real cause is truncation.
  [[noreturn]] void fail(const std::string& what) {
    if (overrun()) truncated();
    throw gzip_error(what + " (near input byte " + std::to_string(input_offset()) + ")");
  }
  bool overrun() const { return cnt_ < 8 * pad_; }

  // Keeps at least 56 bits buffered; past the end, pads with zeros so the hot loop needs no bounds
  // checks, and reports truncation once real bits have run out.
  void refill() {
    if (end_ - p_ >= 8) {
      buf_ |= load_le64(p_) << cnt_;
      p_ += (63 - cnt_) >> 3;
      cnt_ |= 56;
      return;
    }
    if (overrun()) truncated();
    while (cnt_ <= 56) {
      if (p_ < end_) {
        buf_ |= std::uint64_t(*p_++) << cnt_;
      } else {
        if (!padded_) decoded_at_end_ = decoded();
        padded_ = true;
        ++pad_;
      }
      cnt_ += 8;
    }
  }
  unsigned bits(unsigned n) {
    if (cnt_ < n) refill();
    const unsigned v = unsigned(buf_ & ((std::uint64_t(1) << n) - 1));
    buf_ >>= n;
    cnt_ -= n;
    return v;
  }
  void consume(unsigned n) {
    buf_ >>= n;
    cnt_ -= n;
  }

  // Drops to a byte boundary and hands buffered whole bytes back to the input.
  void align_and_rewind() {
    consume(cnt_ & 7u);
    if (overrun()) truncated();
    p_ -= cnt_ / 8 - pad_;
    buf_ = 0;
    cnt_ = 0;
    pad_ = 0;
  }

  static constexpr std::size_t kWindow = std::size_t{1} << 15;  // DEFLATE's largest distance
  static constexpr std::size_t kFlushBytes = std::size_t{4} << 20;

  void ensure(std::size_t n) {
    if (cap_ - pos_ >= n) return;
    if (sink_ && pos_ > kWindow && pos_ + n > kFlushBytes) {
      // Hand on what is new and keep the last 32 KiB, the most a back-reference reaches.
      (*sink_)(std::string_view(o_ + emitted_, pos_ - emitted_));
      handed_ += pos_ - emitted_;
      const std::size_t shift = pos_ - kWindow;
      std::memmove(o_, o_ + shift, kWindow);
      pos_ = emitted_ = kWindow;
      window_start_ = window_start_ > shift ? window_start_ - shift : 0;
      if (cap_ - pos_ >= n) return;
    }
    out_.resize(std::max({cap_ * 2, pos_ + n, std::size_t(1) << 16}));
    o_ = out_.data();
    cap_ = out_.size();
  }

  void stored() {
    align_and_rewind();
    if (end_ - p_ < 4) truncated();
    const unsigned len = load_le16(p_), nlen = load_le16(p_ + 2);
    if ((len ^ 0xFFFFu) != nlen) fail("invalid stored block lengths (LEN does not match NLEN)");
    p_ += 4;
    if (std::size_t(end_ - p_) < len) truncated();
    ensure(len);
    std::memcpy(o_ + pos_, p_, len);
    pos_ += len;
    p_ += len;
  }

  template <unsigned P, std::size_t S, unsigned M>
  std::uint32_t lookup(const HuffTable<P, S, M>& t) const {
    std::uint32_t e = t.e[buf_ & ((std::uint64_t(1) << P) - 1)];
    if (e_kind(e) == k_link) e = t.e[e_value(e) + ((buf_ >> P) & ((std::uint64_t(1) << e_extra(e)) - 1))];
    return e;
  }

  void dynamic() {
    const unsigned hlit = bits(5) + 257, hdist = bits(5) + 1, hclen = bits(4) + 4;
    if (hlit > 286 || hdist > 30) fail("invalid dynamic block header: too many length or distance codes");
    std::array<std::uint8_t, 19> cl_lens{};
    for (unsigned i = 0; i < hclen; ++i) cl_lens[kClOrder[i]] = std::uint8_t(bits(3));
    if (build_table(cl_, cl_lens.data(), 19, kClSymbols.data(), false) != BuildResult::ok)
      fail("invalid code-length Huffman code lengths");

    std::array<std::uint8_t, 286 + 30> lens{};
    const unsigned total = hlit + hdist;
    for (unsigned i = 0; i < total;) {
      if (cnt_ < 15 + 7) refill();
      const std::uint32_t e = lookup(cl_);
      if (e_kind(e) == k_invalid) fail("invalid Huffman code (code lengths)");
      consume(e_len(e));
      const unsigned sym = e_value(e);
      if (sym < 16) {
        lens[i++] = std::uint8_t(sym);
        continue;
      }
      unsigned rep;
      std::uint8_t v = 0;
      if (sym == 16) {
        if (i == 0) fail("invalid code lengths: repeat code with no previous length");
        v = lens[i - 1];
        rep = 3 + bits(2);
      } else if (sym == 17) {
        rep = 3 + bits(3);
      } else {
        rep = 11 + bits(7);
      }
      if (i + rep > total) fail("invalid code lengths: repeat runs past the end");
      std::fill_n(lens.begin() + i, rep, v);
      i += rep;
    }
    if (overrun()) truncated();
    if (lens[256] == 0) fail("invalid dynamic block: missing end-of-block code");
    const auto rl = build_table(lit_, lens.data(), hlit, kLitSymbols.data(), true);
    if (rl == BuildResult::oversubscribed) fail("invalid literal/length Huffman code lengths (over-subscribed)");
    if (rl == BuildResult::incomplete) fail("invalid literal/length Huffman code lengths (incomplete)");
    const auto rd = build_table(dist_, lens.data() + hlit, hdist, kDistSymbols.data(), true);
    if (rd == BuildResult::oversubscribed) fail("invalid distance Huffman code lengths (over-subscribed)");
    if (rd == BuildResult::incomplete) fail("invalid distance Huffman code lengths (incomplete)");
    codes(lit_, dist_);
  }

  // The hot loop: one refill covers a whole length/distance pair (at most 15+5+15+13 = 48 bits).
  void codes(const LitTable& lit, const DistTable& dist) {
    for (;;) {
      if (cnt_ < 48) refill();
      std::uint32_t e = lookup(lit);
      if (e_kind(e) == k_literal) {
        consume(e_len(e));
        if (cap_ - pos_ < 2) ensure(2);
        o_[pos_++] = char(e_value(e));
        // A second literal without another refill when enough bits remain (the common text case).
        if (cnt_ < 15) continue;
        e = lookup(lit);
        if (e_kind(e) != k_literal) continue;
        consume(e_len(e));
        o_[pos_++] = char(e_value(e));
        continue;
      }
      if (e_kind(e) == k_eob) {
        consume(e_len(e));
        return;
      }
      if (e_kind(e) != k_base) fail("invalid Huffman code (literal/length)");
      consume(e_len(e));
      const unsigned nx = e_extra(e);
      const std::size_t length = e_value(e) + unsigned(buf_ & ((1u << nx) - 1));
      consume(nx);

      const std::uint32_t d = lookup(dist);
      if (e_kind(d) != k_base) fail("invalid Huffman code (distance)");
      consume(e_len(d));
      const unsigned dx = e_extra(d);
      const std::size_t distance = e_value(d) + unsigned(buf_ & ((std::uint64_t(1) << dx) - 1));
      consume(dx);
      if (distance > pos_ - window_start_) fail("invalid distance too far back");

      ensure(length + 8);  // 8 bytes of slack for the word-wise copy below
      char* dst = o_ + pos_;
      const char* src = dst - distance;
      if (distance >= 8) {
        // Each 8-byte copy reads only bytes written before it, so overlap is handled.
        for (std::size_t i = 0; i < length; i += 8) std::memcpy(dst + i, src + i, 8);
      } else if (distance == 1) {
        std::memset(dst, *src, length);
      } else {
        for (std::size_t i = 0; i < length; ++i) dst[i] = src[i];
      }
      pos_ += length;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Encoder.

class BitWriter {
 public:
  explicit BitWriter(std::string& out) : out_(out) {}
  void put(std::uint32_t v, unsigned n) {  // n <= 32
    buf_ |= std::uint64_t(v) << cnt_;
    cnt_ += n;
    if (cnt_ >= 32) {
      char b[4] = {char(buf_), char(buf_ >> 8), char(buf_ >> 16), char(buf_ >> 24)};
      out_.append(b, 4);
      buf_ >>= 32;
      cnt_ -= 32;
    }
  }
  void align() {
    while (cnt_ > 0) {
      out_.push_back(char(buf_));
      buf_ >>= 8;
      cnt_ = cnt_ > 8 ? cnt_ - 8 : 0;
    }
    buf_ = 0;
  }

 private:
  std::string& out_;
  std::uint64_t buf_ = 0;
  unsigned cnt_ = 0;
};

// Huffman code lengths limited to `limit` bits. When the optimal code is too deep, frequencies
// are flattened and the code rebuilt (slightly suboptimal, always terminates: equal weights give
// a balanced tree). Ensures at least two codes so every code is complete.
std::vector<std::uint8_t> code_lengths(std::vector<std::uint32_t> freq, unsigned limit) {
  const std::size_t n = freq.size();
  std::vector<std::uint8_t> len(n, 0);
  std::size_t used = 0;
  for (auto f : freq) used += f != 0;
  if (used == 0) return len;
  if (used == 1) {
    for (std::size_t i = 0; i < n; ++i)
      if (freq[i]) len[i] = 1;
    len[len[0] ? 1 : 0] = 1;
    return len;
  }
  for (;;) {
    using Node = std::pair<std::uint64_t, std::size_t>;  // weight, node id
    std::priority_queue<Node, std::vector<Node>, std::greater<>> q;
    std::vector<std::size_t> parent(2 * n, 0);
    for (std::size_t i = 0; i < n; ++i)
      if (freq[i]) q.emplace(freq[i], i);
    std::size_t next = n;
    while (q.size() > 1) {
      const auto a = q.top();
      q.pop();
      const auto b = q.top();
      q.pop();
      parent[a.second] = parent[b.second] = next;
      q.emplace(a.first + b.first, next++);
    }
    const std::size_t root = next - 1;
    std::vector<unsigned> depth(2 * n, 0);
    for (std::size_t id = root; id-- > n;) depth[id] = depth[parent[id]] + 1;  // parents have larger ids
    unsigned max_len = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (freq[i]) {
        len[i] = std::uint8_t(depth[parent[i]] + 1);
        max_len = std::max<unsigned>(max_len, len[i]);
      }
    if (max_len <= limit) return len;
    for (auto& f : freq)
      if (f) f = (f >> 1) | 1u;
  }
}

// Canonical codes, bit-reversed for LSB-first output.
std::vector<std::uint32_t> canonical_codes(const std::vector<std::uint8_t>& len) {
  std::array<unsigned, 16> count{};
  for (auto l : len) ++count[l];
  count[0] = 0;
  std::array<std::uint32_t, 16> next{};
  for (unsigned l = 1, code = 0; l <= 15; ++l) {
    code = (code + count[l - 1]) << 1;
    next[l] = code;
  }
  std::vector<std::uint32_t> codes(len.size(), 0);
  for (std::size_t i = 0; i < len.size(); ++i)
    if (len[i]) codes[i] = reverse_bits(next[len[i]]++, len[i]);
  return codes;
}

struct Symbol {
  std::uint16_t lit_or_len;  // literal byte, or match length 3..258
  std::uint16_t dist;        // 0 for a literal
};

constexpr std::array<std::uint8_t, 259> make_len_symbol() {
  std::array<std::uint8_t, 259> t{};
  for (unsigned l = 3; l <= 258; ++l) {
    unsigned s = 0;
    while (s + 1 < 29 && kLenBase[s + 1] <= l) ++s;
    t[l] = std::uint8_t(s);
  }
  return t;
}
constexpr auto kLenSymbol = make_len_symbol();  // length -> symbol - 257

inline unsigned dist_symbol(unsigned d) {
  return unsigned(std::upper_bound(kDistBase.begin(), kDistBase.end(), d) - kDistBase.begin()) - 1;
}

class Deflater {
 public:
  Deflater(std::string_view data, std::string& out) : d_(reinterpret_cast<const unsigned char*>(data.data())), n_(data.size()), w_(out) {}

  void run() {
    constexpr std::size_t kBlockSymbols = 1 << 15;
    std::size_t block_start = 0;
    std::size_t i = 0;
    syms_.reserve(kBlockSymbols + 2);
    while (i < n_) {
      auto [len, dist] = longest_match(i);
      insert(i);
      if (len >= kMinMatch) {
        // Lazy evaluation: a longer match one byte later wins over this one.
        while (len < kLazyLimit && i + 1 < n_) {
          const auto [len2, dist2] = longest_match(i + 1);
          if (len2 <= len) break;
          syms_.push_back({d_[i], 0});
          ++i;
          insert(i);
          len = len2;
          dist = dist2;
        }
        syms_.push_back({std::uint16_t(len), std::uint16_t(dist)});
        for (std::size_t k = 1; k < len; ++k) insert(i + k);
        i += len;
      } else {
        syms_.push_back({d_[i], 0});
        ++i;
      }
      if (syms_.size() >= kBlockSymbols) {
        emit_block(block_start, i, i >= n_);
        block_start = i;
      }
    }
    if (!syms_.empty() || n_ == 0) emit_block(block_start, i, true);
    w_.align();
  }

 private:
  static constexpr std::size_t kWindow = 1 << 15;
  static constexpr std::size_t kHashBits = 15;
  static constexpr unsigned kMinMatch = 3, kMaxMatch = 258, kLazyLimit = 32, kMaxChain = 32;
  static constexpr std::size_t kTooFar = 4096;  // a 3-byte match farther away costs more than literals

  const unsigned char* d_;
  std::size_t n_;
  BitWriter w_;
  std::vector<std::int64_t> head_ = std::vector<std::int64_t>(std::size_t(1) << kHashBits, -1);
  std::vector<std::int64_t> prev_ = std::vector<std::int64_t>(kWindow, -1);
  std::vector<Symbol> syms_;

  std::size_t hash(std::size_t i) const {
    const std::uint32_t v = std::uint32_t(d_[i]) | std::uint32_t(d_[i + 1]) << 8 | std::uint32_t(d_[i + 2]) << 16;
    return (v * 2654435761u) >> (32 - kHashBits);
  }
  void insert(std::size_t i) {
    if (i + kMinMatch > n_) return;
    const std::size_t h = hash(i);
    prev_[i & (kWindow - 1)] = head_[h];
    head_[h] = std::int64_t(i);
  }
  std::pair<unsigned, unsigned> longest_match(std::size_t i) const {
    if (i + kMinMatch > n_) return {0, 0};
    const std::size_t max_len = std::min<std::size_t>(kMaxMatch, n_ - i);
    unsigned best = 0, best_dist = 0;
    std::int64_t c = head_[hash(i)];
    for (unsigned chain = 0; c >= 0 && chain < kMaxChain; ++chain) {
      const std::size_t j = std::size_t(c);
      if (i - j > kWindow) break;
      if (d_[j + best] == d_[i + best] || best == 0) {
        std::size_t l = 0;
        while (l < max_len && d_[j + l] == d_[i + l]) ++l;
        if (l > best && !(l == kMinMatch && i - j > kTooFar)) {
          best = unsigned(l);
          best_dist = unsigned(i - j);
          if (l == max_len) break;
        }
      }
      const std::int64_t nc = prev_[j & (kWindow - 1)];
      if (nc >= c) break;  // slot reused by a newer position: the chain ends here
      c = nc;
    }
    return {best >= kMinMatch ? best : 0, best_dist};
  }

  void emit_block(std::size_t from, std::size_t to, bool final_block) {
    std::vector<std::uint32_t> lf(286, 0), df(30, 0);
    for (const auto& s : syms_) {
      if (s.dist == 0) {
        ++lf[s.lit_or_len];
      } else {
        ++lf[257 + kLenSymbol[s.lit_or_len]];
        ++df[dist_symbol(s.dist)];
      }
    }
    lf[256] = 1;
    std::uint64_t extra_bits = 0;  // identical for fixed and dynamic
    for (unsigned s = 0; s < 29; ++s) extra_bits += std::uint64_t(lf[257 + s]) * kLenExtra[s];
    for (unsigned s = 0; s < 30; ++s) extra_bits += std::uint64_t(df[s]) * kDistExtra[s];

    // Fixed code.
    std::vector<std::uint8_t> fl(288, 8), fd(30, 5);
    std::fill(fl.begin() + 144, fl.begin() + 256, std::uint8_t(9));
    std::fill(fl.begin() + 256, fl.begin() + 280, std::uint8_t(7));
    std::uint64_t fixed_bits = 3 + extra_bits;
    for (unsigned s = 0; s < 286; ++s) fixed_bits += std::uint64_t(lf[s]) * fl[s];
    for (unsigned s = 0; s < 30; ++s) fixed_bits += std::uint64_t(df[s]) * fd[s];

    // Dynamic code.
    const auto dl_lit = code_lengths(lf, 15);
    auto dl_dist = code_lengths(df, 15);
    std::size_t dist_used = 0;
    for (auto l : dl_dist) dist_used += l != 0;
    if (dist_used == 0) dl_dist[0] = dl_dist[1] = 1;  // no matches: a complete dummy code
    unsigned hlit = 286, hdist = 30;
    while (hlit > 257 && dl_lit[hlit - 1] == 0) --hlit;
    while (hdist > 1 && dl_dist[hdist - 1] == 0) --hdist;
    std::vector<std::uint8_t> seq(dl_lit.begin(), dl_lit.begin() + hlit);
    seq.insert(seq.end(), dl_dist.begin(), dl_dist.begin() + hdist);
    struct Run {
      std::uint8_t sym, extra_value;
    };
    std::vector<Run> runs;
    for (std::size_t k = 0; k < seq.size();) {
      std::size_t r = 1;
      while (k + r < seq.size() && seq[k + r] == seq[k]) ++r;
      const std::uint8_t v = seq[k];
      k += r;
      if (v == 0) {
        while (r >= 11) {
          const std::size_t t = std::min<std::size_t>(r, 138);
          runs.push_back({18, std::uint8_t(t - 11)});
          r -= t;
        }
        if (r >= 3) {
          runs.push_back({17, std::uint8_t(r - 3)});
          r = 0;
        }
      } else {
        runs.push_back({v, 0});
        --r;
        while (r >= 3) {
          const std::size_t t = std::min<std::size_t>(r, 6);
          runs.push_back({16, std::uint8_t(t - 3)});
          r -= t;
        }
      }
      for (; r > 0; --r) runs.push_back({v, 0});
    }
    std::vector<std::uint32_t> cf(19, 0);
    for (const auto& r : runs) ++cf[r.sym];
    const auto cl = code_lengths(cf, 7);
    unsigned hclen = 19;
    while (hclen > 4 && cl[kClOrder[hclen - 1]] == 0) --hclen;
    std::uint64_t dyn_bits = 3 + 5 + 5 + 4 + 3 * std::uint64_t(hclen) + extra_bits;
    for (const auto& r : runs) dyn_bits += cl[r.sym] + (r.sym == 16 ? 2 : r.sym == 17 ? 3 : r.sym == 18 ? 7 : 0);
    for (unsigned s = 0; s < 286; ++s) dyn_bits += std::uint64_t(lf[s]) * dl_lit[s];
    for (unsigned s = 0; s < 30; ++s) dyn_bits += std::uint64_t(df[s]) * dl_dist[s];

    const std::size_t raw = to - from;
    const std::uint64_t stored_bits = (raw / 65535 + 1) * (3 + 7 + 32) + 8 * std::uint64_t(raw);

    if (stored_bits < fixed_bits && stored_bits < dyn_bits) {
      std::size_t k = from;
      do {
        const std::size_t len = std::min<std::size_t>(to - k, 65535);
        const bool last = k + len == to;
        w_.put(final_block && last ? 1u : 0u, 3);  // BTYPE 00
        w_.align();
        w_.put(std::uint32_t(len) | std::uint32_t(len ^ 0xFFFFu) << 16, 32);
        for (std::size_t b = 0; b < len; ++b) w_.put(d_[k + b], 8);
        k += len;
      } while (k < to);
    } else if (fixed_bits <= dyn_bits) {
      w_.put(final_block ? 1u : 0u, 1);
      w_.put(1, 2);
      write_symbols(fl, fd);
    } else {
      w_.put(final_block ? 1u : 0u, 1);
      w_.put(2, 2);
      w_.put(hlit - 257, 5);
      w_.put(hdist - 1, 5);
      w_.put(hclen - 4, 4);
      for (unsigned k = 0; k < hclen; ++k) w_.put(cl[kClOrder[k]], 3);
      const auto cc = canonical_codes(cl);
      for (const auto& r : runs) {
        w_.put(cc[r.sym], cl[r.sym]);
        if (r.sym == 16) w_.put(r.extra_value, 2);
        else if (r.sym == 17) w_.put(r.extra_value, 3);
        else if (r.sym == 18) w_.put(r.extra_value, 7);
      }
      write_symbols(dl_lit, dl_dist);
    }
    syms_.clear();
  }

  void write_symbols(const std::vector<std::uint8_t>& ll, const std::vector<std::uint8_t>& dl) {
    const auto lc = canonical_codes(ll), dc = canonical_codes(dl);
    for (const auto& s : syms_) {
      if (s.dist == 0) {
        w_.put(lc[s.lit_or_len], ll[s.lit_or_len]);
        continue;
      }
      const unsigned ls = kLenSymbol[s.lit_or_len];
      w_.put(lc[257 + ls], ll[257 + ls]);
      w_.put(s.lit_or_len - kLenBase[ls], kLenExtra[ls]);
      const unsigned ds = dist_symbol(s.dist);
      w_.put(dc[ds], dl[ds]);
      w_.put(s.dist - kDistBase[ds], kDistExtra[ds]);
    }
    w_.put(lc[256], ll[256]);
  }
};

void put_le32(std::string& out, std::uint32_t v) {
  const char b[4] = {char(v), char(v >> 8), char(v >> 16), char(v >> 24)};
  out.append(b, 4);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::uint32_t crc32(std::string_view data, std::uint32_t crc) noexcept {
  auto p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  crc = ~crc;
  while (n >= 8) {
    const std::uint32_t a = load_le32(p) ^ crc, b = load_le32(p + 4);
    crc = kCrc[7][a & 0xFFu] ^ kCrc[6][(a >> 8) & 0xFFu] ^ kCrc[5][(a >> 16) & 0xFFu] ^ kCrc[4][a >> 24] ^
          kCrc[3][b & 0xFFu] ^ kCrc[2][(b >> 8) & 0xFFu] ^ kCrc[1][(b >> 16) & 0xFFu] ^ kCrc[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = kCrc[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

bool is_gzip(std::string_view bytes) noexcept {
  return bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1F && static_cast<unsigned char>(bytes[1]) == 0x8B;
}

std::string inflate_raw(std::string_view bytes, std::size_t* consumed) {
  std::string out;
  Inflater inf(bytes, out, 0);
  const std::size_t used = inf.run();
  if (consumed) *consumed = used;
  return out;
}

std::string gunzip(std::string_view bytes) {
  std::string out;
  // The last member's ISIZE is a good first guess of the output size (exact for one member < 4 GiB).
  // Only a hint: corrupt data may claim anything, so a failed reservation is ignored.
  if (bytes.size() >= 18) {
    try {
      const auto* tail = reinterpret_cast<const unsigned char*>(bytes.data()) + bytes.size() - 4;
      out.reserve(std::min<std::size_t>(load_le32(tail), bytes.size() * 1032));  // 1032: deflate's maximum ratio
    } catch (const std::exception&) {
    }
  }
  const ChunkSink append = [&out](std::string_view piece) { out.append(piece); };
  gunzip(bytes, append);
  return out;
}

void gunzip(std::string_view bytes, const ChunkSink& sink) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::size_t n = bytes.size();
  std::uint64_t total = 0;  // decompressed bytes of the members before this one
  auto truncated = [&total](const char* where) {
    throw gzip_error(std::string("truncated gzip data: input ends inside the ") + where +
                     (total ? " (" + std::to_string(total) + " bytes decompressed before it)" : std::string()));
  };
  std::string window;  // the decoder's buffer: at most a few MiB, whatever the output size
  std::size_t at = 0;
  for (bool first = true;; first = false) {
    if (!first) {
      if (at == n) break;
      // Another member, or padding (zeros) that gzip itself tolerates.
      if (b[at] != 0x1F) {
        if (std::all_of(b + at, b + n, [](unsigned char c) { return c == 0; })) break;
        throw gzip_error("trailing garbage after gzip member (at input byte " + std::to_string(at) + ")");
      }
    }
    const std::size_t member = at;
    if (n - at < 10) {
      if (n - at >= 2 && !(b[at] == 0x1F && b[at + 1] == 0x8B)) throw gzip_error("not gzip data (bad magic bytes)");
      if (n - at == 1 && b[at] != 0x1F) throw gzip_error("not gzip data (bad magic bytes)");
      truncated("header");
    }
    if (b[at] != 0x1F || b[at + 1] != 0x8B)
      throw gzip_error("not gzip data (bad magic bytes at input byte " + std::to_string(at) + ")");
    if (b[at + 2] != 8)
      throw gzip_error("unsupported gzip compression method " + std::to_string(b[at + 2]) + " (only 8, deflate, exists)");
    const unsigned flags = b[at + 3];
    if (flags & 0xE0u) throw gzip_error("invalid gzip header: reserved flag bits set");
    at += 10;
    if (flags & 0x04u) {  // FEXTRA
      if (n - at < 2) truncated("header's extra field");
      const std::size_t xlen = load_le16(b + at);
      at += 2;
      if (n - at < xlen) truncated("header's extra field");
      at += xlen;
    }
    for (unsigned f : {0x08u, 0x10u}) {  // FNAME, FCOMMENT: zero-terminated
      if (!(flags & f)) continue;
      const void* z = std::memchr(b + at, 0, n - at);
      if (!z) truncated(f == 0x08u ? "header's file name" : "header's comment");
      at = std::size_t(static_cast<const unsigned char*>(z) - b) + 1;
    }
    if (flags & 0x02u) {  // FHCRC: low 16 bits of the header's CRC-32
      if (n - at < 2) truncated("header");
      const unsigned stored = load_le16(b + at);
      const unsigned computed = crc32(bytes.substr(member, at - member)) & 0xFFFFu;
      if (stored != computed) throw gzip_error("gzip header CRC-16 mismatch");
      at += 2;
    }
    std::uint32_t crc = 0;
    std::uint64_t produced = 0;
    const ChunkSink checked = [&](std::string_view piece) {
      crc = crc32(piece, crc);
      produced += piece.size();
      sink(piece);
    };
    Inflater inf(bytes.substr(at), window, at, &checked);
    try {
      at += inf.run();
    } catch (const gzip_error& e) {
      if (std::string_view(e.what()).starts_with("truncated"))
        throw gzip_error(std::string(e.what()) + " (" + std::to_string(total + inf.decoded_before_end()) + " bytes decompressed before the data ran out)");
      throw;
    }
    total += produced;
    if (n - at < 8) truncated("trailer (CRC-32 and size)");
    const std::uint32_t stored_crc = load_le32(b + at), stored_size = load_le32(b + at + 4);
    at += 8;
    if (crc != stored_crc)
      throw gzip_error("CRC-32 mismatch: the data is corrupt (stored " + hex32(stored_crc) + ", computed " + hex32(crc) + ")");
    if (std::uint32_t(produced) != stored_size)
      throw gzip_error("ISIZE mismatch: the data is corrupt (stored " + std::to_string(stored_size) + " bytes, decoded " +
                       std::to_string(produced) + ")");
  }
}

std::string gzip_compress(std::string_view data) {
  std::string out;
  out.reserve(data.size() / 3 + 64);
  // ID1 ID2 CM FLG MTIME(4) XFL OS: no name, no time (reproducible output), OS unknown.
  const unsigned char header[10] = {0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255};
  out.append(reinterpret_cast<const char*>(header), 10);
  Deflater(data, out).run();
  put_le32(out, crc32(data));
  put_le32(out, std::uint32_t(data.size()));
  return out;
}

}  // namespace expseg::trace
