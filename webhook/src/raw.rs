//! Lookups in raw JSON, one level at a time.
//!
//! The webhook reads a few members of a review (and, for a pod that does not decode, its
//! labels and stash) without decoding the rest. Each level is split into its members with
//! everything below kept as text (a scan, no tree of values), and only the member asked for
//! is split further. The lookups follow `serde_json::Value`'s rules (a repeated key: the last
//! one counts; arrays are indexed by a decimal token, as in `Value::pointer`), so a field
//! read here is the field the parsed document would give.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// One level of a JSON value: its members (object) or elements (array) as raw text.
#[derive(Debug, Default)]
pub enum Level<'a> {
    Object(Vec<(Cow<'a, str>, &'a RawValue)>),
    Array(Vec<&'a RawValue>),
    Null,
    /// A string, number or boolean.
    #[default]
    Scalar,
}

impl<'a> Level<'a> {
    /// The top level of `raw`.
    pub fn of(raw: &'a RawValue) -> Self {
        // `raw` is well-formed JSON, so splitting it fails only on a nesting deeper than
        // serde_json allows, or a number too large for it; neither has members to find.
        serde_json::from_str(raw.get()).unwrap_or_default()
    }

    /// The member `key` of an object (`Value::get`).
    pub fn get(&self, key: &str) -> Option<&'a RawValue> {
        match self {
            Level::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| *v),
            _ => None,
        }
    }

    /// One step of a JSON pointer: a member of an object or an element of an array.
    pub fn step(&self, token: &str) -> Option<&'a RawValue> {
        match self {
            Level::Object(_) => self.get(token),
            Level::Array(items) => index(token).and_then(|i| items.get(i).copied()),
            Level::Null | Level::Scalar => None,
        }
    }
}

/// `Value::pointer` with the tokens already unescaped.
pub fn pointer<'a>(raw: &'a RawValue, tokens: &[&str]) -> Option<&'a RawValue> {
    tokens.iter().try_fold(raw, |at, token| Level::of(at).step(token))
}

/// The string `raw` holds, `None` for any other type.
pub fn string(raw: &RawValue) -> Option<Cow<'_, str>> {
    serde_json::from_str::<Text>(raw.get()).ok().map(|t| t.0)
}

pub fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}

/// An array index as `Value::pointer` reads it: decimal, no sign, no leading zero.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// A string, borrowed from the document when it has no escapes.
pub struct Text<'a>(pub Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(V)
    }
}

/// Any JSON value, split one level.
impl<'de> Deserialize<'de> for Level<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Level<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(key) = map.next_key::<Text<'de>>()? {
                    members.push((key.0, map.next_value::<&'de RawValue>()?));
                }
                Ok(Level::Object(members))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(4));
                while let Some(item) = seq.next_element::<&'de RawValue>()? {
                    items.push(item);
                }
                Ok(Level::Array(items))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Level::Null)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Level::Scalar)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Level::Scalar)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Level::Scalar)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Level::Scalar)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Level::Scalar)
            }
        }
        deserializer.deserialize_any(V)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn raw(v: &Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(v).unwrap()
    }

    #[test]
    fn lookups_agree_with_value_pointer() {
        let doc = json!({
            "metadata": {"labels": {"a/b": "x", "~0": "tilde", "0": "zero"}, "list": ["p", {"q": 1}]},
            "spec": [1, 2],
            "s": "text",
        });
        let text = doc.to_string();
        let escaped = r#"{"k\"ey": "v\n", "dup": 1, "dup": "last"}"#;
        let cases: &[(&str, &[&str])] = &[
            ("/metadata/labels/a~1b", &["metadata", "labels", "a/b"]),
            ("/metadata/labels/~00", &["metadata", "labels", "~0"]),
            ("/metadata/labels/0", &["metadata", "labels", "0"]),
            ("/metadata/list/1/q", &["metadata", "list", "1", "q"]),
            ("/metadata/list/01", &["metadata", "list", "01"]),
            ("/metadata/list/+1", &["metadata", "list", "+1"]),
            ("/metadata/list/2", &["metadata", "list", "2"]),
            ("/spec/volumes", &["spec", "volumes"]),
            ("/s/x", &["s", "x"]),
            ("/missing", &["missing"]),
        ];
        let parsed: Box<RawValue> = serde_json::from_str(&text).unwrap();
        for (ptr, tokens) in cases {
            let want = doc.pointer(ptr);
            let got = pointer(&parsed, tokens).map(|r| serde_json::from_str::<Value>(r.get()).unwrap());
            assert_eq!(got.as_ref(), want, "{ptr}");
        }
        let dup = json!({"k\"ey": "v\n", "dup": "last"});
        let parsed: Box<RawValue> = serde_json::from_str(escaped).unwrap();
        let level = Level::of(&parsed);
        for key in ["k\"ey", "dup"] {
            let got = level.get(key).and_then(string);
            assert_eq!(got.as_deref(), dup[key].as_str(), "{key}");
        }
    }

    #[test]
    fn scalars_and_strings() {
        assert_eq!(string(&raw(&json!("a\"b"))).as_deref(), Some("a\"b"));
        assert_eq!(string(&raw(&json!(5))), None);
        assert_eq!(string(&raw(&json!({"a": "b"}))), None);
        assert!(is_null(&raw(&Value::Null)));
        assert!(!is_null(&raw(&json!({}))));
        assert!(Level::of(&raw(&json!("x"))).get("x").is_none());
        assert!(matches!(Level::of(&raw(&Value::Null)), Level::Null));
        assert!(matches!(Level::of(&raw(&json!(1.5))), Level::Scalar));
        assert!(Level::of(&raw(&json!([1]))).get("0").is_none());
        assert!(matches!(Level::of(&raw(&json!([1, 2]))), Level::Array(items) if items.len() == 2));
    }
}
