//! Kubernetes resource quantities as exact integers.
//!
//! Every quantity is held in milli-units (`1` = 1000, `100m` = 100, `1Ki` = 1,024,000), so
//! sums and differences are exact: no floating point, no drift. Capacity maths in the suite
//! goes through [`ResourceMap`].

use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("quantity {0:?} is not a valid Kubernetes quantity")]
pub struct Error(pub String);

/// Parses a quantity (`4`, `500m`, `1.5`, `8Gi`, `1e3`, `2k`) into milli-units.
pub fn parse_milli(s: &str) -> Result<i128, Error> {
    let bad = || Error(s.to_owned());
    let t = s.trim();
    let (num, suffix) = match t.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E') {
        Some(i) => t.split_at(i),
        None => (t, ""),
    };
    // Decimal exponent form: 1e3, 12E-1.
    let (mantissa, exp10) = match num.find(['e', 'E']) {
        Some(i) if suffix.is_empty() => {
            let e: i32 = num[i + 1..].parse().map_err(|_| bad())?;
            (&num[..i], e)
        }
        Some(_) => return Err(bad()),
        None => (num, 0),
    };
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa.strip_prefix('+').unwrap_or(mantissa)),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if (int_part.is_empty() && frac_part.is_empty())
        || !int_part.chars().all(|c| c.is_ascii_digit())
        || !frac_part.chars().all(|c| c.is_ascii_digit())
    {
        return Err(bad());
    }
    // value = digits * 10^(exp10 - frac_len) * multiplier * 1000
    let digits: i128 = format!("{int_part}{frac_part}").parse().map_err(|_| bad())?;
    let (mul, div10): (i128, i32) = match suffix {
        "" => (1, 0),
        "n" => (1, 9),
        "u" => (1, 6),
        "m" => (1, 3),
        "k" => (1_000, 0),
        "M" => (1_000_000, 0),
        "G" => (1_000_000_000, 0),
        "T" => (1_000_000_000_000, 0),
        "P" => (1_000_000_000_000_000, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        _ => return Err(bad()),
    };
    let mut value = digits
        .checked_mul(mul)
        .ok_or_else(bad)?
        .checked_mul(1000)
        .ok_or_else(bad)?;
    let shift = exp10 - frac_part.len() as i32 - div10;
    if shift >= 0 {
        value = value
            .checked_mul(10i128.checked_pow(shift as u32).ok_or_else(bad)?)
            .ok_or_else(bad)?;
    } else {
        let d = 10i128.checked_pow((-shift) as u32).ok_or_else(bad)?;
        // Kubernetes rounds fractions of a milli-unit up.
        value = (value + d - 1) / d;
    }
    Ok(if neg { -value } else { value })
}

/// Formats milli-units as a quantity: whole units when exact, milli-units otherwise.
pub fn format_milli(v: i128) -> String {
    if v % 1000 == 0 {
        format!("{}", v / 1000)
    } else {
        format!("{v}m")
    }
}

/// A set of named resources (cpu, memory, pods, extended resources…) in milli-units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceMap(pub BTreeMap<String, i128>);

impl ResourceMap {
    /// Parses a Kubernetes resource list; entries that do not parse are skipped and
    /// returned as errors, so one bad object cannot poison a sum.
    pub fn parse<'a>(list: impl IntoIterator<Item = (&'a String, &'a String)>) -> (Self, Vec<Error>) {
        let mut map = BTreeMap::new();
        let mut errors = Vec::new();
        for (name, q) in list {
            match parse_milli(q) {
                Ok(v) => {
                    map.insert(name.clone(), v);
                }
                Err(e) => errors.push(e),
            }
        }
        (Self(map), errors)
    }

    pub fn get(&self, name: &str) -> i128 {
        self.0.get(name).copied().unwrap_or(0)
    }

    pub fn add(&mut self, other: &ResourceMap) {
        for (k, v) in &other.0 {
            // The name is cloned only when it is new here: sums over thousands of pods add
            // the same few names again and again.
            match self.0.get_mut(k) {
                Some(e) => *e += v,
                None => {
                    self.0.insert(k.clone(), *v);
                }
            }
        }
    }

    /// Subtracts what `other` holds of resources this map has; never below zero.
    pub fn saturating_sub(&mut self, other: &ResourceMap) {
        for (k, v) in self.0.iter_mut() {
            *v = (*v - other.get(k)).max(0);
        }
    }

    /// Per resource, the larger of the two.
    pub fn max_with(&mut self, other: &ResourceMap) {
        for (k, v) in &other.0 {
            match self.0.get_mut(k) {
                Some(e) => *e = (*e).max(*v),
                None => {
                    self.0.insert(k.clone(), (*v).max(0));
                }
            }
        }
    }

    /// As a Kubernetes resource list of quantity strings.
    pub fn to_strings(&self) -> BTreeMap<String, String> {
        self.0
            .iter()
            .map(|(k, v)| (k.clone(), format_milli(*v)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_exactly() {
        for (s, milli) in [
            ("4", 4000),
            ("500m", 500),
            ("1.5", 1500),
            ("0.1", 100),
            ("1Ki", 1_024_000),
            ("8Gi", 8 * (1i128 << 30) * 1000),
            ("2k", 2_000_000),
            ("1e3", 1_000_000),
            ("12E-1", 1200),
            ("110", 110_000),
            ("1n", 1),
            ("-2", -2000),
        ] {
            assert_eq!(parse_milli(s), Ok(milli), "{s}");
        }
        for bad in ["", "x", "1Qi", "1.2.3", "Gi", "1e", "--1"] {
            assert!(parse_milli(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formatting_round_trips() {
        assert_eq!(format_milli(4000), "4");
        assert_eq!(format_milli(1500), "1500m");
        for s in ["7", "250m", "8589934592"] {
            assert_eq!(format_milli(parse_milli(s).unwrap()), s);
        }
    }

    #[test]
    fn maps_add_and_subtract_without_going_negative() {
        let list = |pairs: &[(&str, &str)]| {
            let owned: BTreeMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            ResourceMap::parse(&owned).0
        };
        let mut a = list(&[("cpu", "4"), ("memory", "8Gi"), ("pods", "110")]);
        a.add(&list(&[("cpu", "2"), ("example.com/gpu", "1")]));
        assert_eq!(a.get("cpu"), 6000);
        assert_eq!(a.get("example.com/gpu"), 1000);
        a.saturating_sub(&list(&[("cpu", "10"), ("pods", "1")]));
        assert_eq!(a.get("cpu"), 0);
        assert_eq!(a.to_strings()["pods"], "109");
        let owned: BTreeMap<String, String> = [("cpu".to_string(), "lots".to_string())].into();
        let (m, errs) = ResourceMap::parse(&owned);
        assert!(m.0.is_empty());
        assert_eq!(errs.len(), 1);
    }
}
