//! Choices named in configs and flags (the cache policies): every choice,
//! its name, `Display`, and a `FromStr` whose refusal lists the names.

/// Gives a fieldless enum `ALL`, `name()`, `Display` and `FromStr` from
/// one list of `Variant => "name"`.
macro_rules! named_choices {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every choice, for `--help` and reports.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            /// The choice's name in configs and flags.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                Self::ALL
                    .into_iter()
                    .find(|c| c.name() == s)
                    .ok_or_else(|| format!("{s:?} is not one of {}", [$($name),+].join(", ")))
            }
        }
    };
}

pub(crate) use named_choices;
