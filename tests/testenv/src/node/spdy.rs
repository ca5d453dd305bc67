//! SPDY/3.1 framing, as far as a kubelet's streaming endpoints need it: the API server upgrades
//! `kubectl port-forward` to SPDY (k8s.io/apimachinery's httpstream over moby/spdystream, also
//! when kubectl tunnels it through a WebSocket) and the client opens every stream. The server
//! reads SYN_STREAM (headers in a zlib stream primed with SPDY/3's dictionary), DATA and
//! RST_STREAM, answers PING, and writes SYN_REPLY and DATA. spdystream does no flow control
//! (it ignores SETTINGS and WINDOW_UPDATE), so neither does this.

use std::io;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The header-compression dictionary of the SPDY/3 draft (section 2.6.10.1): every header
/// block of a connection is one zlib stream that starts with it in its window.
pub const DICTIONARY: &[u8] = include_bytes!("spdy3-dictionary.bin");

const VERSION: u16 = 3;
const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const FLAG_FIN: u8 = 0x01;
/// The most a header block may inflate to (the port-forward streams carry three short headers).
const MAX_HEADERS: usize = 64 * 1024;

#[derive(Debug, PartialEq)]
pub enum Frame {
    SynStream {
        id: u32,
        headers: Vec<(String, String)>,
    },
    Data {
        id: u32,
        fin: bool,
        data: Vec<u8>,
    },
    RstStream {
        id: u32,
    },
    Ping {
        id: u32,
    },
    GoAway,
    /// SETTINGS, WINDOW_UPDATE, HEADERS, NOOP: nothing a server of client-opened streams acts on.
    Ignored,
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn u32_at(b: &[u8], at: usize) -> io::Result<u32> {
    b.get(at..at + 4).map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(|| invalid("a SPDY frame shorter than its fields"))
}

/// The client's header blocks, inflated in order from one zlib stream.
pub struct HeaderInflater {
    raw: Decompress,
    /// The zlib header (and dictionary id) of the stream is still ahead.
    at_start: bool,
}

impl Default for HeaderInflater {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderInflater {
    /// A raw inflater whose window already holds the dictionary: fed first as a stored
    /// (uncompressed, not final) deflate block, whose output is thrown away. That is what a
    /// preset dictionary is, without needing zlib's `inflateSetDictionary`.
    pub fn new() -> Self {
        let mut raw = Decompress::new(false);
        let len = DICTIONARY.len() as u16;
        let mut stored = vec![0x00];
        stored.extend(len.to_le_bytes());
        stored.extend((!len).to_le_bytes());
        stored.extend(DICTIONARY);
        let mut sink = Vec::with_capacity(DICTIONARY.len());
        raw.decompress_vec(&stored, &mut sink, FlushDecompress::Sync).expect("a stored block inflates");
        debug_assert_eq!(sink, DICTIONARY);
        HeaderInflater { raw, at_start: true }
    }

    pub fn inflate(&mut self, mut block: &[u8]) -> io::Result<Vec<u8>> {
        if self.at_start {
            // CMF, FLG, and with FDICT set the dictionary's Adler-32 (checked: it must be SPDY/3's).
            let (&[cmf, flg], rest) = block.split_first_chunk::<2>().ok_or_else(|| invalid("a SPDY header block without its zlib header"))?;
            if cmf & 0x0f != 8 || (u16::from(cmf) << 8 | u16::from(flg)) % 31 != 0 {
                return Err(invalid("a SPDY header block that is not a zlib stream"));
            }
            block = rest;
            if flg & 0x20 != 0 {
                let id = u32_at(block, 0)?;
                if id != adler32(DICTIONARY) {
                    return Err(invalid(format!("a SPDY header block compressed with dictionary {id:#x}, not SPDY/3's")));
                }
                block = &block[4..];
            }
            self.at_start = false;
        }
        let mut out = Vec::with_capacity(256);
        let start = self.raw.total_in();
        while ((self.raw.total_in() - start) as usize) < block.len() || out.len() == out.capacity() {
            if out.len() >= MAX_HEADERS {
                return Err(invalid(format!("a SPDY header block inflating past {MAX_HEADERS} bytes")));
            }
            out.reserve(1024);
            let before = (self.raw.total_in(), self.raw.total_out());
            let consumed = (self.raw.total_in() - start) as usize;
            self.raw.decompress_vec(&block[consumed..], &mut out, FlushDecompress::Sync).map_err(|e| invalid(format!("a SPDY header block: {e}")))?;
            if (self.raw.total_in(), self.raw.total_out()) == before {
                break;
            }
        }
        Ok(out)
    }
}

/// Adler-32, the checksum zlib names a preset dictionary by.
pub fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in data {
        a = (a + u32::from(byte)) % 65521;
        b = (b + a) % 65521;
    }
    b << 16 | a
}

/// `(name, value)` pairs of an inflated header block: a count, then length-prefixed names and
/// values (32-bit lengths in SPDY/3).
pub fn parse_headers(block: &[u8]) -> io::Result<Vec<(String, String)>> {
    let count = u32_at(block, 0)? as usize;
    let mut at = 4;
    let field = |at: &mut usize| -> io::Result<String> {
        let len = u32_at(block, *at)? as usize;
        let bytes = block.get(*at + 4..*at + 4 + len).ok_or_else(|| invalid("a SPDY header longer than its block"))?;
        *at += 4 + len;
        String::from_utf8(bytes.to_vec()).map_err(|_| invalid("a SPDY header that is not UTF-8"))
    };
    let mut headers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let name = field(&mut at)?;
        let value = field(&mut at)?;
        headers.push((name, value));
    }
    Ok(headers)
}

/// Reads the next frame; `None` at a clean end of the connection.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, headers: &mut HeaderInflater) -> io::Result<Option<Frame>> {
    let mut head = [0u8; 8];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let flags = head[4];
    let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    if head[0] & 0x80 == 0 {
        let id = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        return Ok(Some(Frame::Data { id, fin: flags & FLAG_FIN != 0, data: body }));
    }
    let version = u16::from_be_bytes([head[0] & 0x7f, head[1]]);
    if version != VERSION {
        return Err(invalid(format!("SPDY version {version}; this endpoint speaks SPDY/3.1")));
    }
    let frame = match u16::from_be_bytes([head[2], head[3]]) {
        SYN_STREAM => {
            let id = u32_at(&body, 0)? & 0x7fff_ffff;
            let block = body.get(10..).ok_or_else(|| invalid("a SYN_STREAM shorter than its fields"))?;
            Frame::SynStream { id, headers: parse_headers(&headers.inflate(block)?)? }
        }
        RST_STREAM => Frame::RstStream { id: u32_at(&body, 0)? & 0x7fff_ffff },
        PING => Frame::Ping { id: u32_at(&body, 0)? },
        GOAWAY => Frame::GoAway,
        _ => Frame::Ignored,
    };
    Ok(Some(frame))
}

fn control(kind: u16, flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + body.len());
    out.extend((0x8000 | VERSION).to_be_bytes());
    out.extend(kind.to_be_bytes());
    out.extend((u32::from(flags) << 24 | body.len() as u32).to_be_bytes());
    out.extend(body);
    out
}

/// Builds the server's frames; its header blocks are one zlib stream, flushed per frame.
pub struct FrameWriter {
    deflate: Compress,
}

impl Default for FrameWriter {
    fn default() -> Self {
        FrameWriter { deflate: Compress::new(Compression::default(), true) }
    }
}

impl FrameWriter {
    /// The reply that accepts stream `id`, with no headers (what the kubelet sends).
    pub fn syn_reply(&mut self, id: u32) -> Vec<u8> {
        let empty = 0u32.to_be_bytes();
        let mut block = Vec::with_capacity(64);
        // A sync flush ends the frame's bytes on a block boundary the client can inflate.
        self.deflate.compress_vec(&empty, &mut block, FlushCompress::Sync).expect("deflating four bytes into 64");
        let mut body = id.to_be_bytes().to_vec();
        body.extend(block);
        control(SYN_REPLY, 0, &body)
    }

    pub fn ping(id: u32) -> Vec<u8> {
        control(PING, 0, &id.to_be_bytes())
    }

    /// One DATA frame (at most 16 MiB - 1; callers send smaller chunks).
    pub fn data(id: u32, fin: bool, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + data.len());
        out.extend((id & 0x7fff_ffff).to_be_bytes());
        out.extend((u32::from(if fin { FLAG_FIN } else { 0 }) << 24 | data.len() as u32).to_be_bytes());
        out.extend(data);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dictionary_is_spdy3s() {
        // The Adler-32 every SPDY/3 client puts in its first header block's zlib header.
        assert_eq!(adler32(DICTIONARY), 0xe3c6_a7c2);
        assert_eq!(DICTIONARY.len(), 1423);
    }

    /// A header block as a SPDY/3 client writes one: zlib with the preset dictionary (FDICT),
    /// made here by compressing the dictionary and the block in one raw stream and keeping the
    /// block's part, then a second block on the same stream.
    #[test]
    fn header_blocks_compressed_with_the_dictionary_inflate_in_order() {
        let block = |pairs: &[(&str, &str)]| {
            let mut b = (pairs.len() as u32).to_be_bytes().to_vec();
            for (n, v) in pairs {
                for s in [n, v] {
                    b.extend((s.len() as u32).to_be_bytes());
                    b.extend(s.as_bytes());
                }
            }
            b
        };
        let first = block(&[("streamtype", "data"), ("port", "8082"), ("requestid", "0")]);
        let second = block(&[("streamtype", "error"), ("port", "8082"), ("requestid", "1")]);
        // A raw deflate stream: the dictionary (thrown away by the reader), then each block.
        let mut deflate = Compress::new(Compression::default(), false);
        let mut sink = Vec::with_capacity(4096);
        deflate.compress_vec(DICTIONARY, &mut sink, FlushCompress::Sync).unwrap();
        let mut wire = Vec::with_capacity(4096);
        wire.extend([0x78, 0xbb]);
        wire.extend(adler32(DICTIONARY).to_be_bytes());
        let skip = sink.len();
        deflate.compress_vec(&first, &mut sink, FlushCompress::Sync).unwrap();
        wire.extend(&sink[skip..]);
        let mut later = Vec::with_capacity(4096);
        deflate.compress_vec(&second, &mut later, FlushCompress::Sync).unwrap();

        let mut inflater = HeaderInflater::new();
        let got = parse_headers(&inflater.inflate(&wire).unwrap()).unwrap();
        assert_eq!(got, vec![("streamtype".into(), "data".into()), ("port".into(), "8082".into()), ("requestid".into(), "0".into())]);
        assert_eq!(parse_headers(&inflater.inflate(&later).unwrap()).unwrap()[0], ("streamtype".into(), "error".into()));
    }

    #[test]
    fn a_foreign_dictionary_or_a_truncated_block_is_refused() {
        let mut wire = vec![0x78, 0xbb];
        wire.extend(0x1234_5678u32.to_be_bytes());
        assert!(HeaderInflater::new().inflate(&wire).unwrap_err().to_string().contains("0x12345678"));
        assert!(parse_headers(&[0, 0, 0, 1, 0, 0, 0, 9, b'a']).is_err());
    }

    #[tokio::test]
    async fn frames_read_back_as_written() {
        let mut wire = FrameWriter::data(5, true, b"hello");
        wire.extend(FrameWriter::ping(7));
        let mut r = &wire[..];
        let mut inflater = HeaderInflater::new();
        assert_eq!(read_frame(&mut r, &mut inflater).await.unwrap(), Some(Frame::Data { id: 5, fin: true, data: b"hello".to_vec() }));
        assert_eq!(read_frame(&mut r, &mut inflater).await.unwrap(), Some(Frame::Ping { id: 7 }));
        assert_eq!(read_frame(&mut r, &mut inflater).await.unwrap(), None);
    }
}
