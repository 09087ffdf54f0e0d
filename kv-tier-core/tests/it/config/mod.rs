//! The config: documented ranges, values of the wrong type, documents that are no config, `config
//! check` against building, vLLM's keys, and odd values that must build and run or be refused
//! naming the field, never panic.

/// `config check` agrees with building and keeps secrets out.
mod check;
/// Documents that are no config object, keys given twice.
mod documents;
/// Odd and extreme values build and work or are refused; never a panic.
mod odd_values;
/// Every documented range checked at its edges, naming the field.
mod ranges;
/// Values of the wrong JSON type refused naming their path.
mod types;
/// vLLM's keys keep their meaning or are refused saying why.
mod vllm;
