//! Rules in configuration files: a rule or rule set is its text form.

use super::{Rule, RuleSet};
use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(D::Error::custom)
    }
}

impl Serialize for RuleSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A rule set deserializes from `"1/s; 20/min"` or from a list of rule strings.
impl<'de> Deserialize<'de> for RuleSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RuleSet;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a rule string such as \"1/s; 20/min\" or a list of rule strings")
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<RuleSet, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RuleSet, A::Error> {
                let mut rules = Vec::new();
                while let Some(rule) = seq.next_element::<Rule>()? {
                    rules.push(rule);
                }
                RuleSet::new(rules).map_err(A::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}
