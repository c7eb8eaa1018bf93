// gzip (RFC 1952) / DEFLATE (RFC 1951) reading and writing, standard library only.
//
// The project's dependencies are fixed (no zlib), and allocation traces ship gzip-compressed, so the
// codec lives here. The decoder is table-driven (one lookup per symbol for codes up to 10 bits) and
// verifies every gzip member's CRC-32 and ISIZE. The encoder does hash-chain LZ77 and picks, per
// block, the smallest of stored / fixed Huffman / dynamic Huffman.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace expseg::trace {

// Malformed or truncated compressed data. Messages start with what went wrong ("truncated gzip
// data", "CRC-32 mismatch", "invalid Huffman code", "invalid distance too far back", ...) and give
// the byte offset in the input where it is known; a truncation says how many bytes were decompressed
// before the data ran out (the sink has been handed those bytes).
class gzip_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True when `bytes` starts with the gzip magic (1f 8b).
bool is_gzip(std::string_view bytes) noexcept;

// Receives decompressed data in order, in pieces of a few MiB.
using ChunkSink = std::function<void(std::string_view)>;

// Decompresses all concatenated gzip members of `bytes`. Trailing zero bytes (tape/tar padding) are
// ignored; any other trailing bytes are an error.
std::string gunzip(std::string_view bytes);
// The same, handing the output to `sink` as it is decoded, so memory stays a few MiB whatever the
// output size (a small file may inflate to gigabytes). Each member's CRC-32 and ISIZE are checked
// after its last piece has been handed on: on corrupt data the sink may have seen some of it.
void gunzip(std::string_view bytes, const ChunkSink& sink);

// Decodes one raw DEFLATE stream (no container) starting at `bytes[0]`. When `consumed` is not null
// it receives the number of input bytes the stream used (up to the byte after the final block).
std::string inflate_raw(std::string_view bytes, std::size_t* consumed = nullptr);

// One gzip member, readable by `gzip -d`. Never fails (stored blocks are the fallback).
std::string gzip_compress(std::string_view data);

// CRC-32 as gzip uses it (reflected polynomial 0xEDB88320); `crc` continues a previous result.
std::uint32_t crc32(std::string_view data, std::uint32_t crc = 0) noexcept;

}  // namespace expseg::trace
