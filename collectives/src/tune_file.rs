//! The tuning file: the tuned table (`TunedTable`) as `moelink.AllReduce.tune()`
//! writes it (JSON, format [`TUNE_FORMAT`]) and every AllReduce of the same GPU
//! model and world size loads it: where it is ([`default_tune_file`]:
//! `$MOELINK_AR_TUNE_FILE`, else `~/.cache/moelink/allreduce-<gpu>-<R>gpu.json`),
//! its entries ([`parse_tune_file`], the checks of the Python
//! `_entries_from_json`) and the table they make ([`table_from_entries`], the
//! checks of `AllReduceComm.set_tuned`). A small JSON reader of its own: the
//! crate has no JSON dependency.
//!
//! ```json
//! {"format": "moelink-allreduce-tune/1", "gpu": "NVIDIA H100 80GB HBM3", "world_size": 4,
//!  "entries": [{"collective": "allreduce", "graph": false, "registered": false,
//!               "log2_bytes": 20, "algorithm": "twoshot_ll", "num_blocks": 32,
//!               "num_threads": 512}, ...],
//!  "limits": {...}, "measurements": [...], ...}
//! ```
//! (Keys other than these are the tuner's record and are not read.)

use std::path::{Path, PathBuf};

use comm::{CommError, Result};

use crate::algorithm::Collective;
use crate::select::{parse_algorithm, Choice, TableKey, TunedTable};

/// The environment variable naming the tuning file (`moelink.allreduce.TUNE_FILE_ENV`).
pub const TUNE_FILE_ENV: &str = "MOELINK_AR_TUNE_FILE";
/// The `format` of a tuning file (`moelink.allreduce.TUNE_FORMAT`).
pub const TUNE_FORMAT: &str = "moelink-allreduce-tune/1";

/// One tuned entry as the file holds it (`AllReduce.tuned()`'s tuple in
/// Python): names not yet resolved, so that a file with an unknown name is
/// read (and refused by [`table_from_entries`], as `set_tuned` refuses it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunedEntry {
    pub collective: String,
    pub graph: bool,
    pub registered: bool,
    pub log2_bytes: u32,
    pub algorithm: String,
    pub num_blocks: u32,
    pub num_threads: u32,
}

/// The GPU model as a file name part: runs of characters other than ASCII
/// letters and digits become one `-`, trimmed, lower case (`"gpu"` if
/// nothing is left), as the Python `default_tune_file` makes it.
pub fn gpu_slug(gpu_name: &str) -> String {
    let mut out = String::new();
    for c in gpu_name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let slug = out.trim_matches('-');
    if slug.is_empty() {
        "gpu".into()
    } else {
        slug.into()
    }
}

/// `path` with a leading `~` (alone or before `/`) replaced by `home`.
fn expand_user(path: &str, home: Option<&Path>) -> PathBuf {
    match (path.strip_prefix('~'), home) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => {
            home.join(rest.trim_start_matches('/'))
        }
        _ => PathBuf::from(path),
    }
}

/// The tuning file of `world_size` x `gpu_name` (the Python
/// `default_tune_file`): `$MOELINK_AR_TUNE_FILE` where set and not empty
/// (`~` expanded), else `~/.cache/moelink/allreduce-<gpu_slug>-<R>gpu.json`.
pub fn default_tune_file(gpu_name: &str, world_size: usize) -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let env = comm::env::var(TUNE_FILE_ENV);
    tune_file_path(env.as_deref(), home.as_deref(), gpu_name, world_size)
}

/// [`default_tune_file`] with the environment's two values given.
pub fn tune_file_path(
    env: Option<&str>,
    home: Option<&Path>,
    gpu_name: &str,
    world_size: usize,
) -> PathBuf {
    if let Some(env) = env.filter(|e| !e.is_empty()) {
        return expand_user(env, home);
    }
    let name = format!("allreduce-{}-{world_size}gpu.json", gpu_slug(gpu_name));
    home.map(Path::to_path_buf)
        .unwrap_or_default()
        .join(".cache")
        .join("moelink")
        .join(name)
}

/// The entries of the tuning file `text` for a job of `world_size` x `gpu`
/// (the Python `_entries_from_json`). `Err` says why the file does not apply
/// (not JSON, another format, another GPU model or world size, a missing or
/// mistyped field): the caller ignores such a file with a warning, as
/// `AllReduce.load_tuning` does.
pub fn parse_tune_file(
    text: &str,
    gpu: &str,
    world_size: usize,
) -> std::result::Result<Vec<TunedEntry>, String> {
    let doc = Json::parse(text)?;
    let Json::Object(fields) = &doc else {
        return Err("not a JSON object".into());
    };
    let get = |k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v);
    match get("format") {
        Some(Json::String(f)) if f == TUNE_FORMAT => {}
        other => {
            return Err(format!(
                "not a {TUNE_FORMAT} file (format {})",
                other.map_or("None".into(), Json::repr)
            ))
        }
    }
    let file_gpu = get("gpu");
    let file_world = get("world_size");
    let gpu_ok = matches!(file_gpu, Some(Json::String(g)) if g == gpu);
    let world_ok = matches!(file_world, Some(Json::Number(n)) if *n == world_size as f64);
    if !(gpu_ok && world_ok) {
        let show = |v: Option<&Json>| match v {
            Some(Json::String(s)) => s.clone(),
            Some(v) => v.repr(),
            None => "None".into(),
        };
        return Err(format!(
            "tuned for {} x {}, this job is {world_size} x {gpu}",
            show(file_world),
            show(file_gpu)
        ));
    }
    let entries = match get("entries") {
        None => return Ok(Vec::new()),
        Some(Json::Array(a)) => a,
        Some(v) => return Err(format!("entries must be a list, got {}", v.repr())),
    };
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| entry(i, e))
        .collect()
}

fn entry(i: usize, e: &Json) -> std::result::Result<TunedEntry, String> {
    let Json::Object(fields) = e else {
        return Err(format!("entries[{i}] must be an object, got {}", e.repr()));
    };
    let field = |k: &str| {
        fields
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v)
            .ok_or_else(|| format!("entries[{i}] has no {k:?}"))
    };
    let string = |k: &str| match field(k)? {
        Json::String(s) => Ok(s.clone()),
        v => Err(format!(
            "entries[{i}].{k} must be a string, got {}",
            v.repr()
        )),
    };
    let boolean = |k: &str| match field(k)? {
        Json::Bool(b) => Ok(*b),
        v => Err(format!(
            "entries[{i}].{k} must be a boolean, got {}",
            v.repr()
        )),
    };
    let int = |k: &str, max: u64| match field(k)? {
        Json::Number(n) if n.fract() == 0.0 && *n >= 0.0 && *n <= max as f64 => Ok(*n as u32),
        v => Err(format!(
            "entries[{i}].{k} must be an integer in 0..={max}, got {}",
            v.repr()
        )),
    };
    Ok(TunedEntry {
        collective: string("collective")?,
        graph: boolean("graph")?,
        registered: boolean("registered")?,
        log2_bytes: int("log2_bytes", 64)?,
        algorithm: string("algorithm")?,
        num_blocks: int("num_blocks", u32::MAX as u64)?,
        num_threads: int("num_threads", u32::MAX as u64)?,
    })
}

/// The tuned table of `entries` (`AllReduceComm.set_tuned`): an unknown
/// collective or algorithm name is an `InvalidArgument` (Python's
/// `ValueError`). Every rank must install the same table.
pub fn table_from_entries(entries: &[TunedEntry]) -> Result<TunedTable> {
    let mut t = TunedTable::new();
    for e in entries {
        let c = Collective::parse(&e.collective).ok_or_else(|| {
            CommError::invalid(
                "collective",
                format!(
                    "collective must be 'allreduce' or 'allgather', got {:?}",
                    e.collective
                ),
            )
        })?;
        let algorithm = parse_algorithm(&e.algorithm, c)?;
        t.insert(
            TableKey {
                collective: c,
                graph: e.graph,
                registered: e.registered,
                log2_bytes: e.log2_bytes,
            },
            Choice {
                algorithm,
                num_blocks: e.num_blocks,
                num_threads: e.num_threads,
            },
        );
    }
    Ok(t)
}

// ----- a small JSON reader ------------------------------------------------------

/// A JSON value (objects keep their key order).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses one JSON document (RFC 8259; surrounding whitespace allowed).
    pub fn parse(text: &str) -> std::result::Result<Json, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        p.ws();
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("trailing characters"));
        }
        Ok(v)
    }

    /// A short rendering for messages, as Python's `repr` shows the value.
    fn repr(&self) -> String {
        match self {
            Json::Null => "None".into(),
            Json::Bool(b) => if *b { "True" } else { "False" }.into(),
            Json::Number(n) if n.fract() == 0.0 && n.abs() < 1e15 => format!("{}", *n as i64),
            Json::Number(n) => format!("{n}"),
            Json::String(s) => format!("'{s}'"),
            Json::Array(_) => "a list".into(),
            Json::Object(_) => "an object".into(),
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

/// Nesting bound (a hostile file cannot overflow the stack).
const MAX_DEPTH: usize = 128;

impl Parser<'_> {
    fn err(&self, what: &str) -> String {
        format!("invalid JSON at byte {}: {what}", self.i)
    }

    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn expect(&mut self, lit: &str) -> std::result::Result<(), String> {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(self.err(&format!("expected {lit}")))
        }
    }

    fn value(&mut self, depth: usize) -> std::result::Result<Json, String> {
        if depth > MAX_DEPTH {
            return Err(self.err("nested too deeply"));
        }
        match self.peek() {
            None => Err(self.err("unexpected end")),
            Some(b'n') => self.expect("null").map(|_| Json::Null),
            Some(b't') => self.expect("true").map(|_| Json::Bool(true)),
            Some(b'f') => self.expect("false").map(|_| Json::Bool(false)),
            Some(b'"') => self.string().map(Json::String),
            Some(b'[') => self.items(b']', |p| p.value(depth + 1)).map(Json::Array),
            Some(b'{') => self
                .items(b'}', |p| {
                    if p.peek() != Some(b'"') {
                        return Err(p.err("expected a key"));
                    }
                    let k = p.string()?;
                    p.ws();
                    p.expect(":")?;
                    p.ws();
                    Ok((k, p.value(depth + 1)?))
                })
                .map(Json::Object),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("unexpected character")),
        }
    }

    /// The comma-separated items of an array or object, from its opening
    /// bracket up to and including `close`: `item` reads one, starting at its
    /// first character.
    fn items<T>(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> std::result::Result<T, String>,
    ) -> std::result::Result<Vec<T>, String> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(close) {
            self.i += 1;
            return Ok(items);
        }
        loop {
            self.ws();
            items.push(item(self)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(c) if c == close => {
                    self.i += 1;
                    return Ok(items);
                }
                _ => return Err(self.err(&format!("expected , or {}", close as char))),
            }
        }
    }

    fn number(&mut self) -> std::result::Result<Json, String> {
        let start = self.i;
        while let Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i]).expect("ASCII");
        // Rust's float grammar accepts what JSON's does (and a little more:
        // a leading '+', "1." or ".5", which a JSON writer never emits).
        text.parse::<f64>()
            .map(Json::Number)
            .map_err(|_| format!("invalid JSON at byte {start}: bad number {text:?}"))
    }

    fn hex4(&mut self) -> std::result::Result<u32, String> {
        let h = self
            .s
            .get(self.i..self.i + 4)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| self.err("bad \\u escape"))?;
        self.i += 4;
        Ok(h)
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        self.i += 1; // the opening quote
        let mut out = Vec::new();
        loop {
            let Some(c) = self.peek() else {
                return Err(self.err("unterminated string"));
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(e) = self.peek() else {
                        return Err(self.err("unterminated string"));
                    };
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code = if (0xd800..0xdc00).contains(&hi)
                                && self.s[self.i..].starts_with(b"\\u")
                            {
                                self.i += 2;
                                let lo = self.hex4()?;
                                0x10000 + ((hi - 0xd800) << 10) + (lo.wrapping_sub(0xdc00) & 0x3ff)
                            } else {
                                hi
                            };
                            char::from_u32(code).unwrap_or('\u{fffd}')
                        }
                        _ => return Err(self.err("bad escape")),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| self.err("string is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, Request};

    const GPU: &str = "NVIDIA H100 80GB HBM3";

    /// What `moelink.AllReduce.tune()` writes (`json.dumps(doc, indent=1)`).
    fn doc(world: usize, gpu: &str) -> String {
        format!(
            r#"{{
 "format": "moelink-allreduce-tune/1",
 "gpu": "{gpu}",
 "world_size": {world},
 "moelink": "0.1.0",
 "date": "2026-11-26T10:00:00+00:00",
 "limits": {{"world_size": 4, "max_bytes": 67108864, "max_blocks": 64}},
 "iters": 20,
 "entries": [
  {{"collective": "allreduce", "graph": false, "registered": false, "log2_bytes": 20,
    "algorithm": "twoshot_ll", "num_blocks": 16, "num_threads": 512}},
  {{"collective": "allgather", "graph": true, "registered": false, "log2_bytes": 12,
    "algorithm": "ag_mesh", "num_blocks": 8, "num_threads": 256}}
 ],
 "measurements": [{{"collective": "allreduce", "graph": false, "registered": false,
   "bytes": 1048576, "candidates": [["twoshot_ll", 16, 512, 12.5], ["rsag", 8, 512, 1e1]]}}]
}}
"#
        )
    }

    #[test]
    fn reads_what_the_python_tuner_writes() {
        let e = parse_tune_file(&doc(4, GPU), GPU, 4).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(
            e[0],
            TunedEntry {
                collective: "allreduce".into(),
                graph: false,
                registered: false,
                log2_bytes: 20,
                algorithm: "twoshot_ll".into(),
                num_blocks: 16,
                num_threads: 512,
            }
        );
        let t = table_from_entries(&e).unwrap();
        let req = Request {
            collective: Collective::AllReduce,
            nbytes: 1 << 20,
            registered: false,
            capturing: false,
        };
        let c = t.lookup(&req).unwrap();
        assert_eq!(
            (c.algorithm, c.num_blocks, c.num_threads),
            (Algorithm::TwoShotLl, 16, 512)
        );
        // The graph entries are separate.
        assert!(t
            .lookup(&Request {
                capturing: true,
                ..req
            })
            .is_none());
    }

    #[test]
    fn a_file_of_another_job_is_refused_with_the_python_messages() {
        assert_eq!(
            parse_tune_file(&doc(8, GPU), GPU, 4).unwrap_err(),
            format!("tuned for 8 x {GPU}, this job is 4 x {GPU}")
        );
        assert_eq!(
            parse_tune_file(&doc(4, "NVIDIA H200"), GPU, 4).unwrap_err(),
            format!("tuned for 4 x NVIDIA H200, this job is 4 x {GPU}")
        );
        assert_eq!(
            parse_tune_file(r#"{"format": "x/2"}"#, GPU, 4).unwrap_err(),
            "not a moelink-allreduce-tune/1 file (format 'x/2')"
        );
        assert_eq!(
            parse_tune_file("{}", GPU, 4).unwrap_err(),
            "not a moelink-allreduce-tune/1 file (format None)"
        );
        assert!(parse_tune_file("{\"format\": ", GPU, 4)
            .unwrap_err()
            .starts_with("invalid JSON"));
        let missing = doc(4, GPU).replace("\"log2_bytes\": 20,", "");
        assert_eq!(
            parse_tune_file(&missing, GPU, 4).unwrap_err(),
            "entries[0] has no \"log2_bytes\""
        );
        // Read, but refused by the table (set_tuned's ValueError).
        let unknown = doc(4, GPU).replace("twoshot_ll", "fastest");
        let e = parse_tune_file(&unknown, GPU, 4).unwrap();
        let err = table_from_entries(&e).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument { .. }), "{err}");
    }

    #[test]
    fn the_default_path_is_the_python_one() {
        assert_eq!(gpu_slug(GPU), "nvidia-h100-80gb-hbm3");
        assert_eq!(gpu_slug("  NVIDIA  H200 / x "), "nvidia-h200-x");
        assert_eq!(gpu_slug("**"), "gpu");
        let home = Path::new("/home/u");
        assert_eq!(
            tune_file_path(None, Some(home), GPU, 4),
            Path::new("/home/u/.cache/moelink/allreduce-nvidia-h100-80gb-hbm3-4gpu.json")
        );
        assert_eq!(
            tune_file_path(Some(""), Some(home), GPU, 2),
            Path::new("/home/u/.cache/moelink/allreduce-nvidia-h100-80gb-hbm3-2gpu.json")
        );
        assert_eq!(
            tune_file_path(Some("~/t.json"), Some(home), GPU, 2),
            Path::new("/home/u/t.json")
        );
        assert_eq!(
            tune_file_path(Some("/x/t.json"), Some(home), GPU, 2),
            Path::new("/x/t.json")
        );
    }

    #[test]
    fn json_reader() {
        let v = Json::parse(r#" {"a": [1, -2.5e1, true, null, "\u00e9\ud83d\ude00\n"], "b": {}} "#)
            .unwrap();
        assert_eq!(
            v,
            Json::Object(vec![
                (
                    "a".into(),
                    Json::Array(vec![
                        Json::Number(1.0),
                        Json::Number(-25.0),
                        Json::Bool(true),
                        Json::Null,
                        Json::String("é😀\n".into()),
                    ])
                ),
                ("b".into(), Json::Object(vec![])),
            ])
        );
        for bad in [
            "",
            "[1,]",
            "{\"a\" 1}",
            "[1] 2",
            "\"abc",
            "tru",
            &"[".repeat(200),
        ] {
            assert!(Json::parse(bad).is_err(), "{bad:?}");
        }
    }
}
