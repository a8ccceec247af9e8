//! The server side of SPDY/3.1 as Kubernetes clients speak it (the framing of the spec:
//! SYN_STREAM, SYN_REPLY, DATA, RST_STREAM, PING, GOAWAY; header blocks compressed in one
//! zlib stream per direction with the SPDY/3 dictionary). Enough for `kubectl exec`,
//! `attach` and `port-forward`: the client opens every stream, the server answers each with
//! a SYN_REPLY and then exchanges data on it. Flow control (WINDOW_UPDATE) is not enforced
//! by Kubernetes' SPDY library, so it is ignored here too.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Mutex, mpsc};

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const FLAG_FIN: u8 = 0x01;
/// The largest frame accepted (a header block or a data chunk).
const MAX_FRAME: usize = 1 << 20;
/// The largest data frame sent.
pub const MAX_DATA: usize = 32 * 1024;

/// The SPDY/3 header dictionary (spec section 2.6.10.1): these names, each behind its
/// 32-bit big-endian length, then [`DICTIONARY_TAIL`] as it stands.
const DICTIONARY_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];
const DICTIONARY_TAIL: &str = "100101201202205206300302303304305306307402405406407408409410411412413414415416417\
502504505203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request\
401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented\
503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, \
Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,application/xml,\
application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdch\
charset=utf-8charset=iso-8859-1,utf-,*,enq=0.";

pub fn dictionary() -> Vec<u8> {
    let mut d = Vec::with_capacity(1423);
    for w in DICTIONARY_WORDS {
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(DICTIONARY_TAIL.as_bytes());
    d
}

/// Why a session ended other than by a clean close.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("SPDY: {0}")]
    Io(#[from] std::io::Error),
    #[error("SPDY: {0}")]
    Protocol(String),
}

/// Header names (lower case) and values of one stream.
pub type Headers = Vec<(String, String)>;

/// The value of header `name` (case-insensitive).
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Inflates the peer's header blocks: one zlib stream for the whole session.
pub struct HeaderReader {
    z: Decompress,
    dictionary: Vec<u8>,
}

impl Default for HeaderReader {
    fn default() -> Self {
        Self {
            z: Decompress::new(true),
            dictionary: dictionary(),
        }
    }
}

impl HeaderReader {
    pub fn read(&mut self, block: &[u8]) -> Result<Headers, Error> {
        let mut out = Vec::with_capacity(block.len() * 4 + 256);
        let mut consumed = 0;
        while consumed < block.len() {
            if out.capacity() - out.len() < 1024 {
                out.reserve(4096);
            }
            let before = self.z.total_in();
            let result = self
                .z
                .decompress_vec(&block[consumed..], &mut out, FlushDecompress::Sync);
            consumed += (self.z.total_in() - before) as usize;
            match result {
                Ok(Status::StreamEnd) => break,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.z
                        .set_dictionary(&self.dictionary)
                        .map_err(|e| Error::Protocol(format!("header dictionary: {e}")))?;
                }
                Err(e) => return Err(Error::Protocol(format!("header block: {e}"))),
            }
            if out.len() > MAX_FRAME {
                return Err(Error::Protocol("header block too large".into()));
            }
        }
        // What a sync flush left in the window.
        loop {
            out.reserve(4096);
            let before = out.len();
            if let Err(e) = self.z.decompress_vec(&[], &mut out, FlushDecompress::Sync) {
                return Err(Error::Protocol(format!("header block: {e}")));
            }
            if out.len() == before {
                break;
            }
        }
        parse_headers(&out)
    }
}

fn parse_headers(raw: &[u8]) -> Result<Headers, Error> {
    let bad = || Error::Protocol("truncated header block".into());
    let mut at = 0;
    let mut take = |n: usize| -> Result<&[u8], Error> {
        let s = raw.get(at..at + n).ok_or_else(bad)?;
        at += n;
        Ok(s)
    };
    let u32_of = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let count = u32_of(take(4)?);
    let mut headers = Vec::new();
    for _ in 0..count.min(1024) {
        let n = u32_of(take(4)?);
        let name = String::from_utf8_lossy(take(n)?).to_ascii_lowercase();
        let n = u32_of(take(4)?);
        let value = String::from_utf8_lossy(take(n)?).into_owned();
        for v in value.split('\0') {
            headers.push((name.clone(), v.to_owned()));
        }
    }
    Ok(headers)
}

/// Deflates our header blocks: one zlib stream for the whole session.
pub struct HeaderWriter {
    z: Compress,
}

impl Default for HeaderWriter {
    fn default() -> Self {
        let mut z = Compress::new(Compression::default(), true);
        // A dictionary-less stream is valid too; the dictionary only makes blocks smaller.
        let _ = z.set_dictionary(&dictionary());
        Self { z }
    }
}

impl HeaderWriter {
    pub fn write(&mut self, headers: &[(&str, &str)]) -> Result<Vec<u8>, Error> {
        let mut raw = Vec::new();
        raw.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        for (k, v) in headers {
            for s in [k.to_ascii_lowercase().as_bytes(), v.as_bytes()] {
                raw.extend_from_slice(&(s.len() as u32).to_be_bytes());
                raw.extend_from_slice(s);
            }
        }
        let mut out = Vec::with_capacity(raw.len() + 64);
        let mut consumed = 0;
        loop {
            out.reserve(256);
            let before = self.z.total_in();
            self.z
                .compress_vec(&raw[consumed..], &mut out, FlushCompress::Sync)
                .map_err(|e| Error::Protocol(format!("compressing headers: {e}")))?;
            consumed += (self.z.total_in() - before) as usize;
            // Done when everything went in and the flush left spare room.
            if consumed >= raw.len() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }
}

fn control(kind: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + payload.len());
    f.extend_from_slice(&(0x8003u16).to_be_bytes());
    f.extend_from_slice(&kind.to_be_bytes());
    let len = payload.len() as u32;
    f.push(flags);
    f.extend_from_slice(&len.to_be_bytes()[1..]);
    f.extend_from_slice(payload);
    f
}

fn data_frame(id: u32, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + payload.len());
    f.extend_from_slice(&(id & 0x7fff_ffff).to_be_bytes());
    f.push(if fin { FLAG_FIN } else { 0 });
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    f.extend_from_slice(payload);
    f
}

type Out = Box<dyn AsyncWrite + Send + Unpin>;

struct WriteHalf {
    io: Out,
    headers: HeaderWriter,
}

/// Writes frames of a session; cheap to clone, shared by every stream of it.
#[derive(Clone)]
pub struct Writer(Arc<Mutex<WriteHalf>>);

impl Writer {
    async fn frame(&self, bytes: &[u8]) -> Result<(), Error> {
        let mut w = self.0.lock().await;
        w.io.write_all(bytes).await?;
        w.io.flush().await?;
        Ok(())
    }

    async fn reply(&self, id: u32) -> Result<(), Error> {
        let mut w = self.0.lock().await;
        let block = w.headers.write(&[])?;
        let mut payload = (id & 0x7fff_ffff).to_be_bytes().to_vec();
        payload.extend_from_slice(&block);
        let frame = control(SYN_REPLY, 0, &payload);
        w.io.write_all(&frame).await?;
        w.io.flush().await?;
        Ok(())
    }

    /// Sends `data` on stream `id` (in frames of at most [`MAX_DATA`]), the last one with
    /// FIN when `fin`.
    pub async fn data(&self, id: u32, data: &[u8], fin: bool) -> Result<(), Error> {
        if data.is_empty() {
            return self.frame(&data_frame(id, fin, &[])).await;
        }
        let mut chunks = data.chunks(MAX_DATA).peekable();
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            self.frame(&data_frame(id, fin && last, chunk)).await?;
        }
        Ok(())
    }

    /// Half-closes stream `id` from this side.
    pub async fn fin(&self, id: u32) -> Result<(), Error> {
        self.frame(&data_frame(id, true, &[])).await
    }

    pub async fn reset(&self, id: u32) -> Result<(), Error> {
        let mut payload = (id & 0x7fff_ffff).to_be_bytes().to_vec();
        payload.extend_from_slice(&5u32.to_be_bytes()); // CANCEL
        self.frame(&control(RST_STREAM, 0, &payload)).await
    }

    /// Says goodbye and closes the connection.
    pub async fn close(&self) {
        let mut payload = 0u32.to_be_bytes().to_vec();
        payload.extend_from_slice(&0u32.to_be_bytes());
        let _ = self.frame(&control(GOAWAY, 0, &payload)).await;
        let mut w = self.0.lock().await;
        let _ = w.io.shutdown().await;
    }
}

/// A stream the client opened.
pub struct Stream {
    pub id: u32,
    pub headers: Headers,
    /// What the client sends on it; ends at the client's FIN or RST_STREAM.
    pub data: mpsc::Receiver<Bytes>,
}

/// Serves a SPDY session on `io`: every stream the client opens is answered and handed to
/// the returned receiver, which ends when the connection does.
pub fn serve<IO>(io: IO) -> (mpsc::Receiver<Stream>, Writer)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read, write) = tokio::io::split(io);
    let writer = Writer(Arc::new(Mutex::new(WriteHalf {
        io: Box::new(write),
        headers: HeaderWriter::default(),
    })));
    let (tx, rx) = mpsc::channel(16);
    let w = writer.clone();
    tokio::spawn(async move {
        if let Err(e) = read_loop(read, w, tx).await {
            tracing::debug!(error = %e, "SPDY session ended");
        }
    });
    (rx, writer)
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut read: R,
    writer: Writer,
    accepted: mpsc::Sender<Stream>,
) -> Result<(), Error> {
    let mut headers = HeaderReader::default();
    let mut open: HashMap<u32, mpsc::Sender<Bytes>> = HashMap::new();
    let mut head = [0u8; 8];
    loop {
        match read.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let flags = head[4];
        let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
        if len > MAX_FRAME {
            return Err(Error::Protocol(format!("frame of {len} bytes")));
        }
        let mut payload = vec![0u8; len];
        read.read_exact(&mut payload).await?;
        let id_at = |at: usize| {
            payload
                .get(at..at + 4)
                .map(|b| u32::from_be_bytes([b[0] & 0x7f, b[1], b[2], b[3]]))
                .ok_or_else(|| Error::Protocol("short frame".into()))
        };
        if head[0] & 0x80 == 0 {
            let id = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            if let Some(tx) = open.get(&id) {
                // A stream whose reader is gone just drops what comes.
                if !payload.is_empty() {
                    let _ = tx.send(Bytes::from(payload)).await;
                }
            }
            if flags & FLAG_FIN != 0 {
                open.remove(&id);
            }
            continue;
        }
        let kind = u16::from_be_bytes([head[2], head[3]]);
        match kind {
            SYN_STREAM => {
                let id = id_at(0)?;
                let block = payload.get(10..).unwrap_or_default();
                let stream_headers = headers.read(block)?;
                let (tx, rx) = mpsc::channel(64);
                if flags & FLAG_FIN == 0 {
                    open.insert(id, tx);
                }
                writer.reply(id).await?;
                let stream = Stream {
                    id,
                    headers: stream_headers,
                    data: rx,
                };
                if accepted.send(stream).await.is_err() {
                    return Ok(());
                }
            }
            HEADERS => {
                // Only read to keep the zlib stream in step.
                headers.read(payload.get(4..).unwrap_or_default())?;
            }
            RST_STREAM => {
                open.remove(&id_at(0)?);
            }
            PING => writer.frame(&control(PING, 0, &payload)).await?,
            GOAWAY => return Ok(()),
            // SETTINGS, WINDOW_UPDATE and anything newer: nothing to do.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dictionary_is_the_specs() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert_eq!(&d[..11], b"\0\0\0\x07options");
        assert!(d.ends_with(b",*,enq=0."));
    }

    #[test]
    fn header_blocks_round_trip_across_one_zlib_stream() {
        let mut w = HeaderWriter::default();
        let mut r = HeaderReader::default();
        for port in ["8080", "9090"] {
            let block = w
                .write(&[("streamType", "data"), ("port", port), ("requestID", "0")])
                .unwrap();
            let h = r.read(&block).unwrap();
            assert_eq!(header(&h, "streamtype"), Some("data"));
            assert_eq!(header(&h, "PORT"), Some(port));
        }
        let empty = w.write(&[]).unwrap();
        assert!(r.read(&empty).unwrap().is_empty());
    }

    #[tokio::test]
    async fn streams_are_answered_and_carry_data_both_ways() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (mut accepted, writer) = serve(server);
        let (mut cr, mut cw) = tokio::io::split(client);
        let mut hw = HeaderWriter::default();
        let block = hw.write(&[("streamtype", "stdin")]).unwrap();
        let mut syn = 1u32.to_be_bytes().to_vec();
        syn.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        syn.extend_from_slice(&block);
        cw.write_all(&control(SYN_STREAM, 0, &syn)).await.unwrap();
        cw.write_all(&data_frame(1, true, b"hello")).await.unwrap();
        let mut stream = accepted.recv().await.unwrap();
        assert_eq!(
            (stream.id, header(&stream.headers, "streamType")),
            (1, Some("stdin"))
        );
        assert_eq!(stream.data.recv().await.unwrap(), Bytes::from_static(b"hello"));
        assert!(stream.data.recv().await.is_none(), "FIN ends the stream");
        let mut head = [0u8; 8];
        cr.read_exact(&mut head).await.unwrap();
        assert_eq!(u16::from_be_bytes([head[2], head[3]]), SYN_REPLY);
        let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
        let mut rest = vec![0; len];
        cr.read_exact(&mut rest).await.unwrap();
        assert!(HeaderReader::default().read(&rest[4..]).unwrap().is_empty());
        writer.data(1, b"back", true).await.unwrap();
        cr.read_exact(&mut head).await.unwrap();
        assert_eq!((head[4], head[7]), (FLAG_FIN, 4));
    }
}
