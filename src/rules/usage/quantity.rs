//! Resource quantities as Kubernetes reads and writes them
//! (apimachinery's `resource.Quantity`): the one parser that the extender,
//! the node's matcher and the stand-ins use, so that `8k`, `8000` and
//! `8e3` are all 8 000 devices everywhere.
//!
//! A quantity is `[+-]digits[.digits]` then a suffix: decimal SI
//! (`n u m "" k M G T P E`), binary SI (`Ki Mi Gi Ti Pi Ei`) or a decimal
//! exponent (`e3`, `E-2`). As in apimachinery the number may be empty
//! (`k` and `.` are 0), values are rounded up (away from zero) to a
//! nano, and binary-SI values are capped at 2^63 - 1. The API server
//! stores every quantity in canonical form ([`Quantity::canonical`]):
//! the largest suffix of the same kind that keeps a whole mantissa
//! (`8000` is `8k`, `1024Ki` is `1Mi`, `1.5` is `1500m`), binary SI
//! falling back to decimal SI below 1024 or for fractions (`1.5Ki` is
//! `1536`), and a decimal-SI value beyond `E` written with an exponent.
//!
//! One difference, on purpose: apimachinery keeps arbitrary precision;
//! here the significant digits must fit 128 bits (38 digits), and more are
//! refused with [`Why::Precision`]. No GPU amount comes near that.
//!
//! Why not a crate: k8s-openapi keeps `Quantity` as its string, and the
//! crates that read it (e.g. `k8s-quantity-parser`) go through `f64`,
//! which loses exactness past 2^53 and cannot canonicalise.

/// What a quantity's suffix says about how it is written back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `k`, `M`, ... (and no suffix).
    DecimalSi,
    /// `Ki`, `Mi`, ...
    BinarySi,
    /// `e3`, `E-2`.
    DecimalExponent,
}

/// Why a string is not a usable quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Why {
    #[error("is empty")]
    Empty,
    #[error("is not a number: a quantity is [+-]digits[.digits] then a suffix")]
    Number,
    #[error(
        "has an unknown suffix {0:?} (one of n u m k M G T P E, Ki Mi Gi Ti Pi Ei, \
         or e<exponent>)"
    )]
    Suffix(String),
    #[error("has more than 38 significant digits")]
    Precision,
    #[error("is negative")]
    Negative,
    #[error("is not a whole number")]
    Fraction,
    #[error("is larger than {0}")]
    Overflow(u64),
}

/// A quantity that cannot be read, or not as what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("quantity {value:?} {why}")]
pub struct QuantityError {
    pub(crate) value: String,
    pub(crate) why: Why,
}

/// An exact quantity: `mantissa × 10^exponent`, rounded up to a nano.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    negative: bool,
    /// No trailing zeros, except for 0.
    mantissa: u128,
    /// At least -9 (values are rounded to a nano).
    exponent: i32,
    format: Format,
}

const NANO: i32 = -9;

/// 2^63 - 1, apimachinery's cap for binary-SI values.
const MAX_INT64: u128 = i64::MAX as u128;

impl Quantity {
    /// Reads `text` as the API server does (surrounding whitespace
    /// ignored, as its JSON decoding does).
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let fail = |why| QuantityError {
            value: text.to_owned(),
            why,
        };
        let s = text.trim();
        if s.is_empty() {
            return Err(fail(Why::Empty));
        }
        let (negative, rest) = match s.as_bytes()[0] {
            b'-' => (true, &s[1..]),
            b'+' => (false, &s[1..]),
            _ => (false, s),
        };
        let digits_end = |t: &str| t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (whole, rest) = rest.split_at(digits_end(rest));
        let (fraction, suffix) = match rest.strip_prefix('.') {
            Some(r) => r.split_at(digits_end(r)),
            None => ("", rest),
        };
        let (format, exp10, exp2) = interpret(suffix).ok_or_else(|| {
            // A second sign or point, or a letter before a digit, is a
            // malformed number rather than a suffix.
            if suffix.starts_with(['.', '+', '-']) || suffix.is_empty() {
                fail(Why::Number)
            } else {
                fail(Why::Suffix(suffix.to_owned()))
            }
        })?;
        let digits = format!("{whole}{fraction}");
        let scale = i64::from(exp10) - fraction.len() as i64;
        let (mantissa, exponent) = exact(&digits, scale, exp2).map_err(fail)?;
        let mut q = Quantity {
            negative: negative && mantissa != 0,
            mantissa,
            exponent,
            format,
        };
        if format == Format::BinarySi && q.above(MAX_INT64) {
            q.mantissa = MAX_INT64;
            q.exponent = 0;
        }
        q.normalise();
        Ok(q)
    }

    /// The canonical string the API server stores for this quantity.
    pub fn canonical(&self) -> String {
        if self.mantissa == 0 {
            return "0".into();
        }
        let sign = if self.negative { "-" } else { "" };
        if self.format == Format::BinarySi
            && let Some(mut m) = self.magnitude().filter(|&m| m >= 1024)
        {
            let mut power = 0;
            while m.is_multiple_of(1024) && power < BINARY.len() {
                m /= 1024;
                power += 1;
            }
            let suffix = if power == 0 { "" } else { BINARY[power - 1] };
            return format!("{sign}{m}{suffix}");
        }
        // Decimal: the exponent down to a multiple of 3, the mantissa
        // padded with zeros to keep the value.
        let e = self.exponent - self.exponent.rem_euclid(3);
        let zeros = "0".repeat((self.exponent - e) as usize);
        let suffix = match (self.format, e) {
            (_, 0) => String::new(),
            (Format::BinarySi | Format::DecimalSi, -9..=18) => DECIMAL
                .iter()
                .find(|(_, x)| *x == e)
                .map(|(s, _)| (*s).to_owned())
                .expect("every multiple of 3 in -9..=18 has a suffix"),
            _ => format!("e{e}"),
        };
        format!("{sign}{}{zeros}{suffix}", self.mantissa)
    }

    /// The quantity as a whole, non-negative count no larger than `max`
    /// (a number of devices).
    pub(crate) fn count(&self, max: u64) -> Result<u64, Why> {
        if self.negative {
            return Err(Why::Negative);
        }
        if self.exponent < 0 {
            return Err(Why::Fraction);
        }
        self.magnitude()
            .and_then(|m| u64::try_from(m).ok())
            .filter(|&n| n <= max)
            .ok_or(Why::Overflow(max))
    }

    /// Thousandths of the quantity, rounded up (apimachinery's
    /// `MilliValue`, what kube-scheduler weighs CPU and memory requests
    /// by); `None` past `i128`.
    pub fn milli(&self) -> Option<i128> {
        let e = self.exponent.checked_add(3)?;
        let m = i128::try_from(self.mantissa).ok()?;
        let v = if e >= 0 {
            m.checked_mul(10i128.checked_pow(e as u32)?)?
        } else {
            // e >= -6: values are rounded to a nano.
            let d = 10i128.pow((-e) as u32);
            m / d + i128::from(m % d != 0)
        };
        Some(if self.negative { -v } else { v })
    }

    /// Whether `|value| > max`.
    fn above(&self, max: u128) -> bool {
        if self.exponent >= 0 {
            return self.magnitude().is_none_or(|m| m > max);
        }
        // A fraction: its whole part decides, then whether anything follows.
        match 10u128.checked_pow(self.exponent.unsigned_abs()) {
            Some(d) => {
                let whole = self.mantissa / d;
                whole > max || (whole == max && !self.mantissa.is_multiple_of(d))
            }
            None => false,
        }
    }

    /// `|value|` when it is whole and fits.
    fn magnitude(&self) -> Option<u128> {
        let e = u32::try_from(self.exponent).ok()?;
        self.mantissa.checked_mul(10u128.checked_pow(e)?)
    }

    fn normalise(&mut self) {
        if self.mantissa == 0 {
            self.exponent = 0;
            return;
        }
        while self.mantissa.is_multiple_of(10) {
            self.mantissa /= 10;
            self.exponent += 1;
        }
    }
}

/// `text` in thousandths (a CPU amount in millicores), as kube-scheduler
/// weighs it; `None` when it does not read, is negative or past `u64`.
pub(crate) fn parse_milli(text: &str) -> Option<u64> {
    u64::try_from(Quantity::parse(text).ok()?.milli()?).ok()
}

/// Reads `text` as a whole count of at most `max` (devices): the one
/// function every reader of a resource amount uses.
pub fn parse_count(text: &str, max: u64) -> Result<u64, QuantityError> {
    Quantity::parse(text)?
        .count(max)
        .map_err(|why| QuantityError {
            value: text.to_owned(),
            why,
        })
}

/// The canonical form of `text`, as the API server stores it: for the
/// API-server stand-in.
pub fn canonical(text: &str) -> Result<String, QuantityError> {
    Quantity::parse(text).map(|q| q.canonical())
}

const DECIMAL: [(&str, i32); 9] = [
    ("n", -9),
    ("u", -6),
    ("m", -3),
    ("k", 3),
    ("M", 6),
    ("G", 9),
    ("T", 12),
    ("P", 15),
    ("E", 18),
];

const BINARY: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];

/// A suffix's format, power of ten and power of two.
fn interpret(suffix: &str) -> Option<(Format, i32, u32)> {
    if suffix.is_empty() {
        return Some((Format::DecimalSi, 0, 0));
    }
    if let Some((_, e)) = DECIMAL.iter().find(|(s, _)| *s == suffix) {
        return Some((Format::DecimalSi, *e, 0));
    }
    if let Some(i) = BINARY.iter().position(|s| *s == suffix) {
        return Some((Format::BinarySi, 0, 10 * (i as u32 + 1)));
    }
    let exponent = suffix.strip_prefix(['e', 'E'])?;
    // Go's ParseInt: an optional sign, then digits only.
    let digits = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((Format::DecimalExponent, exponent.parse().ok()?, 0))
}

/// `digits × 10^scale × 2^exp2` rounded up to a nano, as a mantissa and a
/// power of ten (at least [`NANO`]).
fn exact(digits: &str, scale: i64, exp2: u32) -> Result<(u128, i32), Why> {
    let digits = digits.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    let mut scale = scale + (digits.len() - trimmed.len()) as i64;
    if trimmed.is_empty() {
        return Ok((0, 0));
    }
    let mut kept = trimmed;
    let mut round_up = false;
    if exp2 == 0 {
        // Digits below a nano only round up: cut them here, so that a
        // long fraction does not count against the 38 digits.
        let below = (i64::from(NANO) - scale).clamp(0, trimmed.len() as i64) as usize;
        let cut;
        (kept, cut) = trimmed.split_at(trimmed.len() - below);
        round_up = !cut.is_empty();
        scale += below as i64;
    }
    let mut m: u128 = match kept {
        "" => 0,
        _ => kept.parse().map_err(|_| Why::Precision)?,
    };
    m = m.checked_mul(1u128 << exp2).ok_or(Why::Precision)?;
    if scale < i64::from(NANO) {
        // A power of ten past u128 is larger than any mantissa.
        let shift = u32::try_from(i64::from(NANO) - scale).unwrap_or(u32::MAX);
        let (q, r) = match 10u128.checked_pow(shift) {
            Some(d) => (m / d, m % d),
            None => (0, m),
        };
        m = q;
        round_up |= r != 0;
        scale = i64::from(NANO);
    }
    m += u128::from(round_up);
    let scale = i32::try_from(scale).map_err(|_| Why::Precision)?;
    Ok((m, scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Canonical forms, from apimachinery's own quantity tests and the
    /// API server's behaviour.
    #[test]
    fn canonical_forms_match_kubernetes() {
        let table = [
            ("0", "0"),
            ("0k", "0"),
            ("-0", "0"),
            ("0Ki", "0"),
            ("8000", "8k"),
            ("4000", "4k"),
            ("10000", "10k"),
            ("4096", "4096"),
            ("1500", "1500"),
            ("1.5k", "1500"),
            ("0.5", "500m"),
            ("1.5", "1500m"),
            ("1024Ki", "1Mi"),
            ("1536Ki", "1536Ki"),
            ("1.5Ki", "1536"),
            ("1.5Gi", "1536Mi"),
            ("0.5Ki", "512"),
            ("1023", "1023"),
            ("1Ki", "1Ki"),
            ("1000Ki", "1000Ki"),
            ("1000", "1k"),
            ("1000000", "1M"),
            ("1000M", "1G"),
            ("12e6", "12e6"),
            ("1e3", "1e3"),
            ("1E3", "1e3"),
            ("1e1", "10"),
            ("1500e0", "1500"),
            ("100m", "100m"),
            ("0.1m", "100u"),
            ("1n", "1n"),
            ("0.1n", "1n"),
            ("1.0000000001", "1000000001n"),
            ("-8000", "-8k"),
            ("-1.5", "-1500m"),
            ("+7", "7"),
            ("007", "7"),
            (" 8000 ", "8k"),
            ("1000E", "1e21"),
            ("1E", "1E"),
            ("8Ei", "9223372036854775807"),
            ("1Ei", "1Ei"),
            ("k", "0"),
            (".5", "500m"),
            ("5.", "5"),
            ("1e-3", "1e-3"),
            ("0.0000000001Ki", "103n"),
            ("0.5Mi", "512Ki"),
            ("7.5Ei", "7680Pi"),
            ("100Ei", "9223372036854775807"),
            ("1e-20", "1e-9"),
            ("-1e-20", "-1e-9"),
            ("100e-3", "100e-3"),
            ("1000e-3", "1"),
        ];
        for (input, want) in table {
            assert_eq!(canonical(input).as_deref(), Ok(want), "{input:?}");
            // Canonical forms stay as they are.
            assert_eq!(canonical(want).as_deref(), Ok(want), "{want:?}");
        }
    }

    #[test]
    fn counts_are_whole_non_negative_and_bounded() {
        for (input, want) in [
            ("8k", 8000),
            ("8000", 8000),
            ("8e3", 8000),
            ("1.5k", 1500),
            ("1Ki", 1024),
            ("2Mi", 2 * 1024 * 1024),
            ("0", 0),
            ("1000m", 1),
        ] {
            assert_eq!(parse_count(input, u64::MAX), Ok(want), "{input:?}");
        }
        let why = |s: &str, max| parse_count(s, max).unwrap_err().why;
        assert_eq!(why("0.5", u64::MAX), Why::Fraction);
        assert_eq!(why("1500m", u64::MAX), Why::Fraction);
        assert_eq!(why("1e-3", u64::MAX), Why::Fraction);
        assert_eq!(why("-1", u64::MAX), Why::Negative);
        assert_eq!(why("-8k", u64::MAX), Why::Negative);
        assert_eq!(why("1025", 1024), Why::Overflow(1024));
        assert_eq!(why("1e30", u64::MAX), Why::Overflow(u64::MAX));
        assert_eq!(why("20E", u64::MAX), Why::Overflow(u64::MAX));
        assert_eq!(why("", 1), Why::Empty);
        assert_eq!(why("   ", 1), Why::Empty);
        assert_eq!(why("1x", 1), Why::Suffix("x".into()));
        assert_eq!(why("1 k", 1), Why::Suffix(" k".into()));
        assert_eq!(why("1K", 1), Why::Suffix("K".into()));
        assert_eq!(why("1e", 1), Why::Suffix("e".into()));
        assert_eq!(why("1e3.5", 1), Why::Suffix("e3.5".into()));
        assert_eq!(why("1.2.3", 1), Why::Number);
        assert_eq!(why("--1", 1), Why::Number);
        assert_eq!(why("1e99999999999", 1), Why::Suffix("e99999999999".into()));
        assert_eq!(
            why("123456789012345678901234567890123456789012", u64::MAX),
            Why::Precision
        );
        let e = parse_count("1.5", 9).unwrap_err();
        assert_eq!(e.to_string(), "quantity \"1.5\" is not a whole number");
    }

    #[test]
    fn milli_values_round_up() {
        let milli = |s: &str| Quantity::parse(s).unwrap().milli();
        assert_eq!(milli("100m"), Some(100));
        assert_eq!(milli("2"), Some(2000));
        assert_eq!(milli("1Ki"), Some(1_024_000));
        assert_eq!(milli("1.5"), Some(1500));
        assert_eq!(milli("1u"), Some(1));
        assert_eq!(milli("8k"), Some(8_000_000));
        assert_eq!(milli("-2"), Some(-2000));
        assert_eq!(milli("1e40"), None);
    }
}
