//! Conversions between f32 and the 16-bit dtypes, rounded as torch's `Tensor.to` rounds.

use super::CopyOut;
use half::bf16;
use half::slice::HalfFloatSliceExt;

/// An element a step reads as f32.
pub trait ToF32: Copy {
    fn to_f32(self) -> f32;
}

impl ToF32 for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl ToF32 for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// f32 to bf16, round to nearest even, every NaN to torch's quiet NaN (0x7fc0).
#[inline(always)]
pub fn bf16_from_f32(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    bf16::from_bits(if x.is_nan() { 0x7fc0 } else { rounded })
}

/// Writes `params` into an f16 `copy` (a bf16 one is written by the update's own loop).
pub(super) fn write_f16_copy(params: &[f32], copy: &mut CopyOut<'_>) {
    if let CopyOut::F16(out) = copy {
        // half converts with F16C where the CPU has it (round to nearest even, as torch).
        out.convert_from_f32_slice(params);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Agrees with half's round-to-nearest-even on every non-NaN f32.
        #[test]
        fn bf16_rounds_to_nearest_even(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            let ours = bf16_from_f32(x);
            if x.is_nan() {
                prop_assert_eq!(ours.to_bits(), 0x7fc0);
            } else {
                prop_assert_eq!(ours.to_bits(), bf16::from_f32(x).to_bits());
            }
        }

        #[test]
        fn bf16_widens_exactly(bits in any::<u16>()) {
            let b = bf16::from_bits(bits);
            prop_assume!(!b.is_nan());
            prop_assert_eq!(b.to_f32().to_bits(), ToF32::to_f32(b).to_bits());
        }
    }
}
