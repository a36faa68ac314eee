//! An item as read from the batch's body, before it is typed: its fields in order, each
//! value as JSON, or any other JSON value.
//!
//! Why not a `serde_json::Value` per item: an item must be read whatever is wrong with it,
//! so that it gets its own refusal and the others run, but a tree per item (a map with a
//! copy of every key) cost about a tenth of an item's instructions (BENCHMARKS.md,
//! "Batches"). A slot keeps the item's known keys as constants and its fields in a list; an
//! item with exactly the fields of one kind is typed straight from it. Any other item is
//! turned into the tree it would have been and typed as before, so it gets the same answer.

use std::fmt;

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, MapDeserializer};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Every field an item of some kind may carry.
const KNOWN: [&str; 7] = [
    "type",
    "accountId",
    "fromAccountId",
    "toAccountId",
    "amountCents",
    "idempotencyKey",
    "group",
];

/// A field's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Key {
    Known(&'static str),
    Other(String),
}

impl Key {
    fn as_str(&self) -> &str {
        match self {
            Key::Known(name) => name,
            Key::Other(name) => name,
        }
    }

    fn of(name: &str) -> Key {
        match KNOWN.iter().find(|k| **k == name) {
            Some(known) => Key::Known(known),
            None => Key::Other(name.to_owned()),
        }
    }
}

/// An item as read.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Slot {
    /// A JSON object: its fields in the order sent, a repeated key included.
    Fields(Vec<(Key, Value)>),
    /// Any other JSON value.
    Other(Value),
}

impl Slot {
    /// The value of `name`, as a tree keeps it: the last one when the key repeats.
    pub fn get(&self, name: &str) -> Option<&Value> {
        match self {
            Slot::Fields(fields) => fields
                .iter()
                .rev()
                .find(|(k, _)| k.as_str() == name)
                .map(|(_, v)| v),
            Slot::Other(_) => None,
        }
    }

    /// The kind `type` names, when the item is an object whose every key is known and none
    /// repeats: such an item can be typed straight from its fields ([`Slot::typed`]).
    pub fn plain_kind(&self) -> Option<&str> {
        let Slot::Fields(fields) = self else {
            return None;
        };
        let mut seen: Vec<&'static str> = Vec::with_capacity(fields.len());
        for (key, _) in fields {
            match key {
                Key::Known(name) if !seen.contains(name) => seen.push(name),
                _ => return None,
            }
        }
        self.get("type")?.as_str()
    }

    /// The item's fields but `type`, read into `T` (only for an item [`Slot::plain_kind`]
    /// names a kind for; another item is read as having no fields).
    pub fn typed<T: for<'de> Deserialize<'de>>(self) -> Result<T, serde_json::Error> {
        let fields = match self {
            Slot::Fields(fields) => fields,
            Slot::Other(_) => Vec::new(),
        };
        let rest = fields.into_iter().filter_map(|(key, value)| match key {
            Key::Known("type") | Key::Other(_) => None,
            Key::Known(name) => Some((name, value)),
        });
        let mut map = MapDeserializer::<_, serde_json::Error>::new(rest);
        let t = T::deserialize(MapAccessDeserializer::new(&mut map))?;
        map.end()?;
        Ok(t)
    }

    /// The tree this item would have been read as.
    pub fn into_value(self) -> Value {
        match self {
            Slot::Fields(fields) => {
                let mut map = Map::new();
                for (key, value) in fields {
                    let name = match key {
                        Key::Known(name) => name.to_owned(),
                        Key::Other(name) => name,
                    };
                    map.insert(name, value);
                }
                Value::Object(map)
            }
            Slot::Other(value) => value,
        }
    }
}

impl<'de> Deserialize<'de> for Slot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SlotVisitor)
    }
}

struct SlotVisitor;

impl<'de> Visitor<'de> for SlotVisitor {
    type Value = Slot;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Slot, A::Error> {
        let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(6).min(16));
        while let Some(key) = map.next_key_seed(KeySeed)? {
            fields.push((key, map.next_value::<Value>()?));
        }
        Ok(Slot::Fields(fields))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Slot, A::Error> {
        let mut values = Vec::new();
        while let Some(value) = seq.next_element::<Value>()? {
            values.push(value);
        }
        Ok(Slot::Other(Value::Array(values)))
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Slot, E> {
        Ok(Slot::Other(Value::Bool(b)))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Slot, E> {
        Ok(Slot::Other(Value::Number(n.into())))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Slot, E> {
        Ok(Slot::Other(Value::Number(n.into())))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Slot, E> {
        Ok(Slot::Other(
            Number::from_f64(n).map_or(Value::Null, Value::Number),
        ))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Slot, E> {
        Ok(Slot::Other(Value::String(s.to_owned())))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Slot, E> {
        Ok(Slot::Other(Value::String(s)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Slot, E> {
        Ok(Slot::Other(Value::Null))
    }
}

/// A field's name, without a copy when it is a known one.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
        Ok(Key::of(s))
    }
}
