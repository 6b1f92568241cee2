//! The limits of a layer as configured: rules per tier, and the default tier.

use std::fmt;

use ratelimit_core::{Rule, RuleSet};

use super::clip::Clip;
use crate::error::BuildError;

/// What a layer decides with: the rules of its default tier (`""`), the rules of each
/// named tier (plan), and which tier takes requests the selector puts in none.
///
/// Build a layer from it with [`RateLimitLayerBuilder::limits`](crate::RateLimitLayerBuilder::limits),
/// or put it in place of a running layer's with [`LimitsHandle::replace`](crate::LimitsHandle::replace).
/// With the `serde` feature it deserializes from a configuration file, rule sets in
/// their text form:
///
/// ```toml
/// rules = "10/s; 200/min"        # tier "": requests in no named tier
/// default_tier = "free"          # optional; "" when there are top-level rules
///
/// [tiers]
/// free = "100/h name=free"
/// pro = "10000/h name=pro"
/// ```
///
/// Tier names are checked as the file is read (1 to 64 of `A-Z a-z 0-9 _ - .`, each
/// once), and rule texts are at most [`MAX_RULE_TEXT`](Self::MAX_RULE_TEXT) bytes, so a
/// parser that knows lines (TOML, YAML) names the line of a bad one. To read a file with
/// bounds on its size and tiers, off the request path, use
/// [`LimitsFile`](crate::LimitsFile).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    pub(crate) rules: Option<RuleSet>,
    pub(crate) tiers: Vec<(String, RuleSet)>,
    pub(crate) default_tier: Option<String>,
}

impl Limits {
    /// The longest rule text (a rule set's, or one rule's in a list) read from a
    /// configuration file, in bytes: 16 rules (the most in a set) of 128 bytes. Checked
    /// before the text is parsed, so that a file cannot make the parser chew megabytes.
    pub const MAX_RULE_TEXT: usize = 2048;

    /// Limits of one tier, `""`: every request is decided against `rules`.
    pub fn new(rules: RuleSet) -> Self {
        Self {
            rules: Some(rules),
            ..Self::default()
        }
    }

    /// Limits with named tiers only (add them with [`tier`](Self::tier)).
    pub fn tiered() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the tier `name`, decided against `rules`.
    #[must_use]
    pub fn tier(mut self, name: impl Into<String>, rules: RuleSet) -> Self {
        let name = name.into();
        match self.tiers.iter_mut().find(|(n, _)| *n == name) {
            Some(tier) => tier.1 = rules,
            None => self.tiers.push((name, rules)),
        }
        self
    }

    /// The tier of requests the selector puts in no tier (`""`, the top-level rules, by
    /// default, when there are some).
    #[must_use]
    pub fn default_tier(mut self, name: impl Into<String>) -> Self {
        self.default_tier = Some(name.into());
        self
    }

    /// The top-level rules (the tier `""`), if any.
    pub fn rules(&self) -> Option<&RuleSet> {
        self.rules.as_ref()
    }

    /// The named tiers, in the order given.
    pub fn tiers(&self) -> impl Iterator<Item = (&str, &RuleSet)> {
        self.tiers.iter().map(|(n, r)| (n.as_str(), r))
    }

    /// The rules of tier `name` (`""` for the top-level rules).
    pub fn tier_rules(&self, name: &str) -> Option<&RuleSet> {
        if name.is_empty() {
            return self.rules.as_ref();
        }
        self.tiers.iter().find(|(n, _)| n == name).map(|(_, r)| r)
    }

    /// Every tier, the top-level rules first as `""`.
    pub(crate) fn all_tiers(&self) -> impl Iterator<Item = (&str, &RuleSet)> {
        self.rules.iter().map(|r| ("", r)).chain(self.tiers())
    }

    /// Checks what a layer needs of its limits, whatever its other settings: at least one
    /// rule, valid tier names, and a default tier that exists.
    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        if self.rules.is_none() && self.tiers.is_empty() {
            return Err(ratelimit_core::ConfigError::EmptyRuleSet.into());
        }
        // A set, not a scan of the tiers before each: limits from a file may hold
        // thousands of tiers.
        let mut seen = std::collections::HashSet::with_capacity(self.tiers.len());
        for (name, _) in &self.tiers {
            check_tier_name(name)?;
            if !seen.insert(name.as_str()) {
                return Err(BuildError::DuplicateTier(name.clone()));
            }
        }
        if let Some(name) = &self.default_tier {
            if self.tier_rules(name).is_none() {
                return Err(BuildError::UnknownDefaultTier(Clip::owned(name)));
            }
        }
        Ok(())
    }
}

fn check_tier_name(name: &str) -> Result<(), BuildError> {
    if Rule::is_valid_name(name) {
        Ok(())
    } else {
        Err(BuildError::BadTierName(Clip::owned(name)))
    }
}

/// `rules = "…"; tiers: free = "…", pro = "…"; default tier "free"`, the form the limits
/// take in logs.
impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if let Some(rules) = &self.rules {
            write!(f, "rules = \"{rules}\"")?;
            sep = "; ";
        }
        if !self.tiers.is_empty() {
            write!(f, "{sep}tiers: ")?;
            for (i, (name, rules)) in self.tiers.iter().enumerate() {
                let comma = if i == 0 { "" } else { ", " };
                write!(f, "{comma}{name} = \"{rules}\"")?;
            }
            sep = "; ";
        }
        if let Some(name) = &self.default_tier {
            write!(f, "{sep}default tier {name:?}")?;
        }
        Ok(())
    }
}

#[cfg(feature = "serde")]
mod serde_impl {
    use std::borrow::Cow;
    use std::collections::HashSet;
    use std::fmt;

    use ratelimit_core::{Rule, RuleSet};
    use serde::de::{Error, MapAccess, SeqAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{check_tier_name, Clip, Limits};
    use crate::error::BuildError;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Raw {
        rules: Option<RuleText>,
        #[serde(default)]
        tiers: Tiers,
        default_tier: Option<String>,
    }

    #[derive(Default)]
    struct Tiers(Vec<(String, RuleSet)>);

    /// A rule set read as `RuleSet` reads it (a string, or a list of rule strings), each
    /// text refused above [`Limits::MAX_RULE_TEXT`] bytes before it is parsed.
    struct RuleText(RuleSet);

    fn check_len<E: Error>(text: &str) -> Result<(), E> {
        if text.len() > Limits::MAX_RULE_TEXT {
            return Err(E::custom(format_args!(
                "a rule text of {} bytes, more than {} (\"{}\")",
                text.len(),
                Limits::MAX_RULE_TEXT,
                Clip(text)
            )));
        }
        Ok(())
    }

    impl<'de> Deserialize<'de> for RuleText {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = RuleText;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a rule string such as \"1/s; 20/min\" or a list of rule strings")
                }
                fn visit_str<E: Error>(self, v: &str) -> Result<RuleText, E> {
                    check_len(v)?;
                    v.parse().map(RuleText).map_err(E::custom)
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RuleText, A::Error> {
                    let mut rules = Vec::new();
                    while let Some(text) = seq.next_element::<Cow<'de, str>>()? {
                        // One past the most a set holds is enough for `RuleSet::new` to
                        // say there are too many.
                        if rules.len() > ratelimit_core::MAX_RULES {
                            break;
                        }
                        check_len(&text)?;
                        rules.push(text.parse::<Rule>().map_err(A::Error::custom)?);
                    }
                    RuleSet::new(rules).map(RuleText).map_err(A::Error::custom)
                }
            }
            d.deserialize_any(V)
        }
    }

    impl<'de> Deserialize<'de> for Tiers {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Tiers;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a table of tier name = rule set")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Tiers, A::Error> {
                    let mut tiers: Vec<(String, RuleSet)> = Vec::new();
                    let mut seen = HashSet::new();
                    while let Some(name) = map.next_key::<String>()? {
                        check_tier_name(&name).map_err(A::Error::custom)?;
                        if !seen.insert(name.clone()) {
                            return Err(A::Error::custom(BuildError::DuplicateTier(name)));
                        }
                        let rules = map.next_value::<RuleText>()?.0;
                        tiers.push((name, rules));
                    }
                    Ok(Tiers(tiers))
                }
            }
            d.deserialize_map(V)
        }
    }

    /// Reads `rules`, `tiers` (a map of name to rule set) and `default_tier`, all
    /// optional but one rule somewhere; unknown fields are refused.
    impl<'de> Deserialize<'de> for Limits {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let raw = Raw::deserialize(d)?;
            let limits = Limits {
                rules: raw.rules.map(|r| r.0),
                tiers: raw.tiers.0,
                default_tier: raw.default_tier,
            };
            limits.validate().map_err(D::Error::custom)?;
            Ok(limits)
        }
    }

    impl Serialize for Limits {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            struct TierMap<'a>(&'a [(String, RuleSet)]);
            impl Serialize for TierMap<'_> {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    let mut map = s.serialize_map(Some(self.0.len()))?;
                    for (name, rules) in self.0 {
                        map.serialize_entry(name, rules)?;
                    }
                    map.end()
                }
            }
            let mut map = s.serialize_map(None)?;
            if let Some(rules) = &self.rules {
                map.serialize_entry("rules", rules)?;
            }
            if let Some(name) = &self.default_tier {
                map.serialize_entry("default_tier", name)?;
            }
            if !self.tiers.is_empty() {
                map.serialize_entry("tiers", &TierMap(&self.tiers))?;
            }
            map.end()
        }
    }
}
