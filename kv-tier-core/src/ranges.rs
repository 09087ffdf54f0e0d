//! Range checks for config numbers, with errors that name the field and the range (for the
//! manager's config and every tier's).

use crate::error::{Error, Result};

/// Checks that `value` of `field` lies in `min..=max` (and is a number), with an error that
/// names the field and the range. For tier configs too.
pub fn check_range(field: &str, value: f64, min: f64, max: f64) -> Result<()> {
    if value.is_nan() || value < min || value > max {
        return Err(Error::config(
            field,
            format!("must be between {min} and {max}, got {value}"),
        ));
    }
    Ok(())
}

/// [`check_range`] for integers.
pub fn check_range_u64(field: &str, value: u64, min: u64, max: u64) -> Result<()> {
    if value < min || value > max {
        return Err(Error::config(
            field,
            format!("must be between {min} and {max}, got {value}"),
        ));
    }
    Ok(())
}
