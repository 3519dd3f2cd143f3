//! The part of Python's pickle that a `torch.save` of a state dict uses: a writer of the
//! protocol-2 stream `torch.save` itself writes (an `OrderedDict` of
//! `torch._utils._rebuild_tensor_v2` calls over persistent storages), and a reader that
//! runs such a stream (protocols 2 to 4) without executing anything: the only callables
//! it knows build a dict or describe a tensor, and anything else is an error naming it.

use std::collections::HashMap;

// Opcodes, as Python's `pickle` module names them.
const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const GLOBAL: u8 = b'c';
const STACK_GLOBAL: u8 = 0x93;
const REDUCE: u8 = b'R';
const BUILD: u8 = b'b';
const BINPERSID: u8 = b'Q';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_LIST: u8 = b']';
const APPEND: u8 = b'a';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEM: u8 = b's';
const SETITEMS: u8 = b'u';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const FRAME: u8 = 0x95;

/// A tensor as `_rebuild_tensor_v2` describes it: a view of a storage.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TensorRef {
    /// The storage class's name (`FloatStorage`, ...).
    pub storage_type: String,
    /// The storage's key: its record is `data/<key>` in the archive.
    pub key: String,
    pub offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
}

/// The values a state dict's pickle is made of.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `module.name`, a callable not yet called.
    Global(String),
    /// A persistent id's storage: (storage class, key).
    Storage(String, String),
    Tensor(TensorRef),
}

/// The deepest nesting of containers a stream may build (a state dict needs 4), so that
/// no recursion over a value goes deep.
const MAX_DEPTH: usize = 32;
/// The most values memo reads may copy in all, so that a small stream cannot grow
/// without bound by copying a value into itself.
const MAX_COPIED: usize = 1_000_000;

/// Runs a pickle stream, returning the value it leaves.
pub(super) fn load(bytes: &[u8]) -> Result<Value, String> {
    let mut input = Input { bytes, at: 0 };
    let mut copied = 0usize;
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    loop {
        let at = input.at;
        let op = input.byte()?;
        match op {
            PROTO => {
                let version = input.byte()?;
                if !(2..=5).contains(&version) {
                    return Err(format!("pickle protocol {version} is not supported"));
                }
            }
            FRAME => {
                input.take(8)?;
            }
            STOP => return stack.pop().ok_or_else(|| "an empty pickle".to_string()),
            MARK => marks.push(stack.len()),
            GLOBAL => {
                let module = input.line()?;
                let name = input.line()?;
                stack.push(Value::Global(format!("{module}.{name}")));
            }
            STACK_GLOBAL => {
                let name = pop_str(&mut stack)?;
                let module = pop_str(&mut stack)?;
                stack.push(Value::Global(format!("{module}.{name}")));
            }
            REDUCE => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                stack.push(call(callable, args)?);
            }
            BUILD => {
                // The state set on an object: a state dict's `_metadata` (module
                // versions), which loading does not need.
                pop(&mut stack)?;
                if stack.is_empty() {
                    return Err("BUILD with nothing to build".into());
                }
            }
            BINPERSID => {
                let id = pop(&mut stack)?;
                stack.push(persistent(id)?);
            }
            NONE => stack.push(Value::None),
            NEWTRUE => stack.push(Value::Bool(true)),
            NEWFALSE => stack.push(Value::Bool(false)),
            BININT => {
                let b = input.take(4)?;
                stack.push(Value::Int(
                    i32::from_le_bytes([b[0], b[1], b[2], b[3]]).into(),
                ));
            }
            BININT1 => stack.push(Value::Int(input.byte()?.into())),
            BININT2 => {
                let b = input.take(2)?;
                stack.push(Value::Int(u16::from_le_bytes([b[0], b[1]]).into()));
            }
            LONG1 => {
                let n = input.byte()? as usize;
                let b = input.take(n)?;
                stack.push(Value::Int(long(b)?));
            }
            BINFLOAT => {
                let b = input.take(8)?;
                let mut be = [0u8; 8];
                be.copy_from_slice(b);
                stack.push(Value::Float(f64::from_be_bytes(be)));
            }
            BINUNICODE | SHORT_BINUNICODE | BINUNICODE8 => {
                let n = match op {
                    SHORT_BINUNICODE => input.byte()? as usize,
                    BINUNICODE => input.u32()? as usize,
                    _ => {
                        let b = input.take(8)?;
                        usize::try_from(u64::from_le_bytes(b.try_into().map_err(|_| "short")?))
                            .map_err(|_| "a string too long".to_string())?
                    }
                };
                let text = std::str::from_utf8(input.take(n)?)
                    .map_err(|_| format!("a string at byte {at} is not UTF-8"))?;
                stack.push(Value::Str(text.to_string()));
            }
            EMPTY_TUPLE => stack.push(Value::Tuple(Vec::new())),
            TUPLE => {
                let items = since_mark(&mut stack, &mut marks)?;
                stack.push(Value::Tuple(nestable(items, at)?));
            }
            TUPLE1 | TUPLE2 | TUPLE3 => {
                let n = usize::from(op - TUPLE1 + 1);
                if stack.len() < n {
                    return Err(format!("a tuple of {n} at byte {at} on a shorter stack"));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(nestable(items, at)?));
            }
            EMPTY_LIST => stack.push(Value::List(Vec::new())),
            APPEND | APPENDS => {
                let items = if op == APPEND {
                    vec![pop(&mut stack)?]
                } else {
                    since_mark(&mut stack, &mut marks)?
                };
                let items = nestable(items, at)?;
                match stack.last_mut() {
                    Some(Value::List(list)) => list.extend(items),
                    _ => return Err(format!("append to a non-list at byte {at}")),
                }
            }
            EMPTY_DICT => stack.push(Value::Dict(Vec::new())),
            SETITEM | SETITEMS => {
                let items = if op == SETITEM {
                    let value = pop(&mut stack)?;
                    let key = pop(&mut stack)?;
                    vec![key, value]
                } else {
                    since_mark(&mut stack, &mut marks)?
                };
                let items = nestable(items, at)?;
                if items.len() % 2 != 0 {
                    return Err(format!("an odd number of dict items at byte {at}"));
                }
                let Some(Value::Dict(dict)) = stack.last_mut() else {
                    return Err(format!("setitem on a non-dict at byte {at}"));
                };
                let mut items = items.into_iter();
                while let (Some(key), Some(value)) = (items.next(), items.next()) {
                    dict.push((key, value));
                }
            }
            BINPUT | LONG_BINPUT | MEMOIZE => {
                let index = match op {
                    BINPUT => input.byte()?.into(),
                    LONG_BINPUT => input.u32()?,
                    _ => memo.len() as u32,
                };
                let top = stack.last().ok_or("memoize on an empty stack")?;
                memo.insert(index, top.clone());
            }
            BINGET | LONG_BINGET => {
                let index = if op == BINGET {
                    input.byte()?.into()
                } else {
                    input.u32()?
                };
                let value = memo
                    .get(&index)
                    .ok_or_else(|| format!("memo {index} read before it was written"))?;
                copied = copied.saturating_add(count(value));
                if copied > MAX_COPIED {
                    return Err(format!(
                        "a pickle that copies more than {MAX_COPIED} values"
                    ));
                }
                stack.push(value.clone());
            }
            other => {
                return Err(format!(
                    "pickle opcode 0x{other:02x} at byte {at} is not supported"
                ));
            }
        }
    }
}

/// What calling `callable` with `args` makes; only the callables of a state dict.
fn call(callable: Value, args: Value) -> Result<Value, String> {
    let Value::Global(name) = callable else {
        return Err(format!("a call of {callable:?}, not of a global"));
    };
    let Value::Tuple(mut args) = args else {
        return Err(format!("{name} called with {args:?}, not a tuple"));
    };
    match name.as_str() {
        "collections.OrderedDict" if args.is_empty() => Ok(Value::Dict(Vec::new())),
        "torch._utils._rebuild_tensor_v2" if (6..=7).contains(&args.len()) => {
            args.truncate(4);
            let mut args = args.into_iter();
            let (Some(storage), Some(offset), Some(size), Some(stride)) =
                (args.next(), args.next(), args.next(), args.next())
            else {
                return Err("_rebuild_tensor_v2 without its arguments".into());
            };
            let Value::Storage(storage_type, key) = storage else {
                return Err(format!("_rebuild_tensor_v2 of {storage:?}, not a storage"));
            };
            Ok(Value::Tensor(TensorRef {
                storage_type,
                key,
                offset: int(&offset)?,
                size: ints(&size)?,
                stride: ints(&stride)?,
            }))
        }
        // A parameter saved as such: its data.
        "torch._utils._rebuild_parameter" if args.len() == 3 => Ok(args.swap_remove(0)),
        _ => Err(format!(
            "`{name}` with {} arguments: not part of a state dict of tensors",
            args.len()
        )),
    }
}

/// `('storage', torch.<Kind>Storage, key, location, numel)`.
fn persistent(id: Value) -> Result<Value, String> {
    if let Value::Tuple(items) = &id
        && let [Value::Str(tag), Value::Global(class), key, Value::Str(_), _] = items.as_slice()
        && tag == "storage"
        && let Some(class) = class.strip_prefix("torch.")
    {
        let key = match key {
            Value::Str(key) => key.clone(),
            Value::Int(key) => key.to_string(),
            _ => return Err(format!("a storage key {key:?}")),
        };
        return Ok(Value::Storage(class.to_string(), key));
    }
    Err(format!("persistent id {id:?} is not a torch storage"))
}

/// `items`, refused when putting them in a container would nest deeper than
/// [`MAX_DEPTH`].
fn nestable(items: Vec<Value>, at: usize) -> Result<Vec<Value>, String> {
    if items.iter().any(|item| depth(item) >= MAX_DEPTH) {
        return Err(format!(
            "values nested deeper than {MAX_DEPTH} at byte {at}"
        ));
    }
    Ok(items)
}

/// Containers nested in `value` (bounded by [`MAX_DEPTH`] for every value `load` builds).
fn depth(value: &Value) -> usize {
    match value {
        Value::Tuple(items) | Value::List(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Dict(items) => {
            1 + items
                .iter()
                .map(|(k, v)| depth(k).max(depth(v)))
                .max()
                .unwrap_or(0)
        }
        _ => 0,
    }
}

/// Values in `value`, itself included.
fn count(value: &Value) -> usize {
    match value {
        Value::Tuple(items) | Value::List(items) => 1 + items.iter().map(count).sum::<usize>(),
        Value::Dict(items) => {
            1 + items
                .iter()
                .map(|(k, v)| count(k) + count(v))
                .sum::<usize>()
        }
        _ => 1,
    }
}

fn int(value: &Value) -> Result<i64, String> {
    match value {
        Value::Int(n) => Ok(*n),
        other => Err(format!("{other:?} where an integer belongs")),
    }
}

fn ints(value: &Value) -> Result<Vec<i64>, String> {
    match value {
        Value::Tuple(items) => items.iter().map(int).collect(),
        other => Err(format!("{other:?} where a tuple of integers belongs")),
    }
}

/// A little-endian two's-complement integer of up to 8 bytes.
fn long(bytes: &[u8]) -> Result<i64, String> {
    if bytes.len() > 8 {
        return Err(format!("an integer of {} bytes", bytes.len()));
    }
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    let mut full = [if negative { 0xff } else { 0 }; 8];
    full[..bytes.len()].copy_from_slice(bytes);
    Ok(i64::from_le_bytes(full))
}

fn pop(stack: &mut Vec<Value>) -> Result<Value, String> {
    stack
        .pop()
        .ok_or_else(|| "a pickle that pops an empty stack".to_string())
}

fn pop_str(stack: &mut Vec<Value>) -> Result<String, String> {
    match pop(stack)? {
        Value::Str(text) => Ok(text),
        other => Err(format!("{other:?} where a name belongs")),
    }
}

fn since_mark(stack: &mut Vec<Value>, marks: &mut Vec<usize>) -> Result<Vec<Value>, String> {
    let mark = marks
        .pop()
        .ok_or("a pickle that uses a mark it never set")?;
    if mark > stack.len() {
        return Err("a mark above the stack".into());
    }
    Ok(stack.split_off(mark))
}

struct Input<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| format!("the pickle ends inside a value at byte {}", self.at))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A newline-terminated ASCII line (GLOBAL's operands).
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.bytes[self.at..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("a GLOBAL without its newline")?;
        let text = std::str::from_utf8(&rest[..end]).map_err(|_| "a GLOBAL that is not UTF-8")?;
        self.at += end + 1;
        Ok(text.to_string())
    }
}

/// Writes the pickle of an `OrderedDict` of tensors, as `torch.save` does: one entry per
/// (name, tensor), each over storage key `i` (its index), and no memo.
pub(super) fn state_dict(entries: &[(String, TensorRef, usize)]) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    global(&mut out, "collections", "OrderedDict");
    out.extend([EMPTY_TUPLE, REDUCE, MARK]);
    for (name, tensor, numel) in entries {
        string(&mut out, name);
        global(&mut out, "torch._utils", "_rebuild_tensor_v2");
        out.push(MARK);
        // The persistent id: ('storage', class, key, location, numel).
        out.push(MARK);
        string(&mut out, "storage");
        global(&mut out, "torch", &tensor.storage_type);
        string(&mut out, &tensor.key);
        string(&mut out, "cpu");
        integer(&mut out, *numel as i64);
        out.extend([TUPLE, BINPERSID]);
        integer(&mut out, tensor.offset);
        for dims in [&tensor.size, &tensor.stride] {
            out.push(MARK);
            for &d in dims.iter() {
                integer(&mut out, d);
            }
            out.push(TUPLE);
        }
        // requires_grad, and empty backward hooks.
        out.push(NEWFALSE);
        global(&mut out, "collections", "OrderedDict");
        out.extend([EMPTY_TUPLE, REDUCE, TUPLE, REDUCE]);
    }
    out.extend([SETITEMS, STOP]);
    out
}

fn global(out: &mut Vec<u8>, module: &str, name: &str) {
    out.push(GLOBAL);
    out.extend(module.as_bytes());
    out.push(b'\n');
    out.extend(name.as_bytes());
    out.push(b'\n');
}

fn string(out: &mut Vec<u8>, text: &str) {
    out.push(BINUNICODE);
    out.extend((text.len() as u32).to_le_bytes());
    out.extend(text.as_bytes());
}

fn integer(out: &mut Vec<u8>, n: i64) {
    if let Ok(small) = u8::try_from(n) {
        out.extend([BININT1, small]);
    } else if let Ok(int) = i32::try_from(n) {
        out.push(BININT);
        out.extend(int.to_le_bytes());
    } else {
        out.extend([LONG1, 8]);
        out.extend(n.to_le_bytes());
    }
}
