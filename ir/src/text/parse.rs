//! Reads the text format back into a [`Graph`] (see the parent module for the format).
//!
//! The format is line oriented, so the source is split into lines and each line is lexed on its
//! own into a handful of token kinds; the parser then reads one declaration per line. Errors carry
//! the 1-based line and column of the offending token and say what was expected and what was
//! found. Nothing here panics, whatever the input.

use crate::dtype::{DType, TensorType};
use crate::graph::{Graph, InputKind, Meta, Phase, Remat, ValueId};
use crate::mesh::{Mesh, Placement, Placements};
use crate::op::{Attr, Op};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

/// Why a text could not be read as a graph, and where (1-based line and column, in characters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: {}",
            self.line, self.col, self.message
        )
    }
}

impl std::error::Error for ParseError {}

/// Reads a graph from its text. Checks syntax and names only: the output types are taken as
/// written, and whether they (and the operand counts) suit each op is the verifier's business.
pub fn parse(src: &str) -> Result<Graph, ParseError> {
    let mut lines = src
        .lines()
        .enumerate()
        .map(|(i, text)| Line::lex(text, i + 1))
        .filter(|line| !matches!(line, Ok(line) if line.tokens.is_empty()));
    let end = end_of_input(src);

    let mut header = lines
        .next()
        .ok_or_else(|| end.error("unexpected end of input: expected `graph NAME {`".into()))??;
    let mut parser = Parser::new(header.header()?);
    loop {
        let mut line = lines.next().ok_or_else(|| {
            end.error("unexpected end of input: the graph is missing its closing `}`".into())
        })??;
        if line.eat('}') {
            if line.peek().is_some() {
                return Err(line.after_closing_brace());
            }
            break;
        }
        parser.statement(&mut line)?;
    }
    if let Some(line) = lines.next() {
        return Err(line?.after_closing_brace());
    }
    Ok(parser.graph)
}

/// A position in the source.
#[derive(Clone, Copy)]
struct Pos {
    line: usize,
    col: usize,
}

impl Pos {
    fn error(self, message: String) -> ParseError {
        ParseError {
            line: self.line,
            col: self.col,
            message,
        }
    }
}

/// Where the input ends: just after its last character.
fn end_of_input(src: &str) -> Pos {
    let line = src.matches('\n').count() + 1;
    let last = src.rsplit('\n').next().unwrap_or_default();
    Pos {
        line,
        col: last.chars().count() + 1,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tok<'a> {
    /// One of `{ } ( ) [ ] , : = #`.
    Punct(char),
    /// `%name`, stored without the `%`.
    Value(&'a str),
    /// A run of letters, digits and `_ . + -`: a keyword, a name, a dtype or a number.
    Word(&'a str),
}

impl fmt::Display for Tok<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Punct(c) => write!(f, "`{c}`"),
            Tok::Value(name) => write!(f, "`%{name}`"),
            Tok::Word(word) => write!(f, "`{word}`"),
        }
    }
}

#[derive(Clone, Copy)]
struct Token<'a> {
    tok: Tok<'a>,
    col: usize,
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

fn is_word_char(c: char) -> bool {
    is_name_char(c) || c == '-' || c == '+'
}

/// Names of graphs, inputs and outputs: `[A-Za-z_][A-Za-z0-9_.]*`.
fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(is_name_char)
}

/// The tokens of one line, with a cursor.
struct Line<'a> {
    number: usize,
    tokens: Vec<Token<'a>>,
    pos: usize,
    /// The column just after the last token, where "found end of line" points.
    end_col: usize,
}

impl<'a> Line<'a> {
    fn lex(text: &'a str, number: usize) -> Result<Line<'a>, ParseError> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let byte_at = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
        let scan = |from: usize, pred: fn(char) -> bool| {
            (from..chars.len())
                .find(|&i| !pred(chars[i].1))
                .unwrap_or(chars.len())
        };
        let mut line = Line {
            number,
            tokens: Vec::new(),
            pos: 0,
            end_col: 1,
        };
        let mut i = 0;
        while let Some(&(_, c)) = chars.get(i) {
            let col = i + 1;
            let (tok, end) = match c {
                ' ' | '\t' | '\r' => {
                    i += 1;
                    continue;
                }
                '/' if chars.get(i + 1).is_some_and(|&(_, c)| c == '/') => break,
                '{' | '}' | '(' | ')' | '[' | ']' | ',' | ':' | '=' | '#' | '@' => {
                    (Tok::Punct(c), i + 1)
                }
                '%' => {
                    let end = scan(i + 1, is_name_char);
                    if end == i + 1 {
                        return Err(line.error(col, "expected a value name after `%`".into()));
                    }
                    (Tok::Value(&text[byte_at(i + 1)..byte_at(end)]), end)
                }
                c if is_word_char(c) => {
                    let end = scan(i, is_word_char);
                    (Tok::Word(&text[byte_at(i)..byte_at(end)]), end)
                }
                other => {
                    let message = format!("unexpected character `{}`", other.escape_debug());
                    return Err(line.error(col, message));
                }
            };
            line.tokens.push(Token { tok, col });
            line.end_col = end + 1;
            i = end;
        }
        Ok(line)
    }

    fn error(&self, col: usize, message: String) -> ParseError {
        ParseError {
            line: self.number,
            col,
            message,
        }
    }

    fn peek(&self) -> Option<Tok<'a>> {
        self.peek_at(0)
    }

    fn peek_at(&self, ahead: usize) -> Option<Tok<'a>> {
        self.tokens.get(self.pos + ahead).map(|t| t.tok)
    }

    /// Column of the next token, or of the end of the line.
    fn col(&self) -> usize {
        self.tokens.get(self.pos).map_or(self.end_col, |t| t.col)
    }

    /// Moves past the next token.
    fn advance(&mut self) {
        self.pos = (self.pos + 1).min(self.tokens.len());
    }

    /// "expected {what}, found {the next token}", at the next token.
    fn expected(&self, what: &str) -> ParseError {
        let found = self
            .peek()
            .map_or_else(|| "end of line".to_string(), |t| t.to_string());
        self.error(self.col(), format!("expected {what}, found {found}"))
    }

    fn after_closing_brace(&self) -> ParseError {
        let found = self.peek().map(|t| t.to_string()).unwrap_or_default();
        self.error(
            self.col(),
            format!("unexpected {found} after the graph's closing `}}`"),
        )
    }

    fn eat(&mut self, punct: char) -> bool {
        let found = self.peek() == Some(Tok::Punct(punct));
        if found {
            self.advance();
        }
        found
    }

    fn expect(&mut self, punct: char, context: &str) -> Result<(), ParseError> {
        if self.eat(punct) {
            Ok(())
        } else {
            Err(self.expected(&format!("`{punct}` {context}")))
        }
    }

    fn expect_end(&self, what: &str) -> Result<(), ParseError> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.expected(what)),
        }
    }

    fn word(&mut self, what: &str) -> Result<(&'a str, usize), ParseError> {
        match self.peek() {
            Some(Tok::Word(word)) => {
                let col = self.col();
                self.advance();
                Ok((word, col))
            }
            _ => Err(self.expected(what)),
        }
    }

    fn value_name(&mut self, what: &str) -> Result<(&'a str, usize), ParseError> {
        match self.peek() {
            Some(Tok::Value(name)) => {
                let col = self.col();
                self.advance();
                Ok((name, col))
            }
            _ => Err(self.expected(what)),
        }
    }

    /// A non-negative integer written in decimal digits only.
    fn unsigned<T: FromStr>(&self, word: &str, col: usize, what: &str) -> Result<T, ParseError> {
        if word.is_empty() || !word.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.error(
                col,
                format!("expected {what} (a non-negative integer), found `{word}`"),
            ));
        }
        word.parse()
            .map_err(|_| self.error(col, format!("{what} `{word}` is out of range")))
    }

    /// `graph NAME {`
    fn header(&mut self) -> Result<String, ParseError> {
        if self.peek() != Some(Tok::Word("graph")) {
            return Err(self.expected("`graph NAME {`"));
        }
        self.advance();
        let (name, col) = self.word("a graph name")?;
        if !is_name(name) {
            return Err(self.error(col, format!("invalid graph name `{name}`: names are a letter or `_` followed by letters, digits, `_` and `.`")));
        }
        self.expect('{', "after the graph name")?;
        self.expect_end("end of line after `{`")?;
        Ok(name.to_string())
    }

    /// `DTYPE[d0,d1,...]`
    fn tensor_type(&mut self) -> Result<TensorType, ParseError> {
        let (name, col) = self.word("a type such as `f32[2,3]`")?;
        let dtype = DType::from_name(name).ok_or_else(|| {
            self.error(
                col,
                format!("unknown dtype `{name}` (known: f64, f32, bf16, i64, i32, bool)"),
            )
        })?;
        self.expect('[', "after the dtype")?;
        let mut shape = Vec::new();
        if !self.eat(']') {
            loop {
                let (dim, col) = self.word("a dimension size")?;
                shape.push(self.unsigned(dim, col, "a dimension size")?);
                if self.eat(']') {
                    break;
                }
                if !self.eat(',') {
                    return Err(self.expected("`,` or `]` in the shape"));
                }
            }
        }
        Ok(TensorType::new(dtype, shape))
    }

    /// An attribute value: a number, `true`/`false`, an integer list or a name.
    fn attr_value(&mut self) -> Result<Attr, ParseError> {
        if self.eat('[') {
            let mut ints = Vec::new();
            if !self.eat(']') {
                loop {
                    let (word, col) = self.word("an integer")?;
                    ints.push(self.int(word, col)?);
                    if self.eat(']') {
                        break;
                    }
                    if !self.eat(',') {
                        return Err(self.expected("`,` or `]` in the list"));
                    }
                }
            }
            return Ok(Attr::Ints(ints));
        }
        let (word, col) = self.word("an attribute value")?;
        let digits = word.strip_prefix('-').unwrap_or(word);
        let numeric = digits.starts_with(|c: char| c.is_ascii_digit() || c == '.');
        Ok(match word {
            "true" => Attr::Bool(true),
            "false" => Attr::Bool(false),
            "inf" => Attr::Float(f64::INFINITY),
            "-inf" => Attr::Float(f64::NEG_INFINITY),
            "NaN" => Attr::Float(f64::NAN),
            _ if numeric && digits.bytes().all(|b| b.is_ascii_digit()) => {
                Attr::Int(self.int(word, col)?)
            }
            _ if numeric => Attr::Float(
                word.parse()
                    .map_err(|_| self.error(col, format!("invalid number `{word}`")))?,
            ),
            _ if is_name(word) => Attr::Ident(word.to_string()),
            _ => {
                return Err(self.error(
                    col,
                    format!("expected an attribute value (a number, `true`, `false`, a list `[1,2]` or a name), found `{word}`"),
                ))
            }
        })
    }

    fn int(&self, word: &str, col: usize) -> Result<i64, ParseError> {
        let digits = word.strip_prefix('-').unwrap_or(word);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.error(col, format!("expected an integer, found `{word}`")));
        }
        word.parse()
            .map_err(|_| self.error(col, format!("integer `{word}` is out of range")))
    }

    /// `PHASE [MODULE] [TAG=VALUE ...]`, after the `#`.
    fn meta(&mut self) -> Result<Meta, ParseError> {
        let (phase, col) = self.word("a phase (fwd, loss, bwd, opt) after `#`")?;
        let phase = Phase::from_short(phase).ok_or_else(|| {
            self.error(
                col,
                format!("unknown phase `{phase}` (known: fwd, loss, bwd, opt)"),
            )
        })?;
        let module = match (self.peek(), self.peek_at(1)) {
            (Some(Tok::Word(module)), next) if next != Some(Tok::Punct('=')) => {
                self.advance();
                module
            }
            _ => "",
        };
        let mut meta = Meta::new(module, phase);
        let mut seen = Vec::new();
        while self.peek().is_some() {
            let (key, col) = self.word("a tag `name=value`")?;
            self.expect('=', &format!("after the tag name `{key}`"))?;
            let (value, value_col) = self.word(&format!("a value for the tag `{key}`"))?;
            if seen.contains(&key) {
                return Err(self.error(col, format!("the tag `{key}` is given twice")));
            }
            seen.push(key);
            let number = |what| self.unsigned::<u32>(value, value_col, what);
            match key {
                "layer" if value == "none" => meta.layer = None,
                "layer" => meta.layer = Some(number("a layer index or `none`")?),
                "micro" => meta.micro_batch = Some(number("a micro-batch index")?),
                "remat" => {
                    meta.tags.remat = Some(Remat::from_name(value).ok_or_else(|| {
                        self.error(
                            value_col,
                            format!(
                                "unknown remat policy `{value}` (known: save, recompute, offload)"
                            ),
                        )
                    })?)
                }
                "bucket" => meta.tags.bucket = Some(number("a bucket index")?),
                "stream" => meta.tags.stream = Some(number("a stream index")?),
                "region" => meta.tags.region = Some(number("a region index")?),
                _ => {
                    return Err(self.error(
                        col,
                        format!(
                        "unknown tag `{key}` (known: layer, micro, remat, bucket, stream, region)"
                    ),
                    ))
                }
            }
        }
        Ok(meta)
    }
}

/// Where the parser is in the graph body: inputs, then nodes, then outputs.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Section {
    Inputs,
    Nodes,
    Outputs,
}

struct Parser<'a> {
    graph: Graph,
    /// Every value defined so far, by its name in the text.
    values: HashMap<&'a str, ValueId>,
    output_names: HashSet<&'a str>,
    section: Section,
}

impl<'a> Parser<'a> {
    fn new(name: String) -> Self {
        Parser {
            graph: Graph::new(name),
            values: HashMap::new(),
            output_names: HashSet::new(),
            section: Section::Inputs,
        }
    }

    fn lookup(&self, line: &Line<'a>, name: &str, col: usize) -> Result<ValueId, ParseError> {
        self.values
            .get(name)
            .copied()
            .ok_or_else(|| line.error(col, format!("unknown value `%{name}`")))
    }

    /// Moves on to `section`, refusing to go back to an earlier one.
    fn enter(&mut self, line: &Line<'a>, section: Section) -> Result<(), ParseError> {
        if section < self.section {
            let message = match section {
                Section::Inputs => "inputs must be declared before nodes and outputs",
                _ => "nodes must come before outputs",
            };
            return Err(line.error(line.col(), message.into()));
        }
        self.section = section;
        Ok(())
    }

    fn statement(&mut self, line: &mut Line<'a>) -> Result<(), ParseError> {
        match line.peek() {
            Some(Tok::Word("input")) => self.input(line, InputKind::Data),
            Some(Tok::Word("param")) => self.input(line, InputKind::Param),
            Some(Tok::Word("state")) => self.input(line, InputKind::State),
            Some(Tok::Word("output")) => self.output(line),
            Some(Tok::Word("mesh")) => self.mesh(line),
            Some(Tok::Value(_)) => self.node(line),
            _ => Err(line.expected(
                "`mesh`, `input`, `param`, `state`, a node `%v: TYPE = op(...)`, `output` or `}`",
            )),
        }
    }

    /// `mesh NAME=SIZE, NAME=SIZE`, before the inputs.
    fn mesh(&mut self, line: &mut Line<'a>) -> Result<(), ParseError> {
        let col = line.col();
        if self.section != Section::Inputs || !self.graph.inputs.is_empty() {
            return Err(line.error(col, "the mesh must be declared before the inputs".into()));
        }
        if self.graph.mesh.is_some() {
            return Err(line.error(col, "the mesh is declared twice".into()));
        }
        line.advance();
        let mut text = String::new();
        loop {
            let (name, _) = line.word("a mesh dimension `NAME=SIZE`")?;
            line.expect('=', "after the mesh dimension name")?;
            let (size, _) = line.word("the mesh dimension's size")?;
            text.push_str(&format!("{name}={size},"));
            if !line.eat(',') {
                break;
            }
        }
        line.expect_end("`,` or end of line after the mesh")?;
        self.graph.mesh = Some(Mesh::parse(&text).map_err(|m| line.error(col, m))?);
        Ok(())
    }

    /// `@ [shard(0), replicate, partial(sum)]` after an input or output, if present.
    fn placements(&mut self, line: &mut Line<'a>) -> Result<Option<Placements>, ParseError> {
        if !line.eat('@') {
            return Ok(None);
        }
        line.expect('[', "after `@`")?;
        let mut placements = Vec::new();
        loop {
            let col = line.col();
            let (word, _) = line.word("a placement: shard(D), replicate or partial(sum|avg)")?;
            let mut text = word.to_string();
            if line.eat('(') {
                let (arg, _) = line.word("the placement's argument")?;
                line.expect(')', "after the placement's argument")?;
                text = format!("{word}({arg})");
            }
            placements.push(Placement::parse(&text).map_err(|m| line.error(col, m))?);
            if line.eat(']') {
                break;
            }
            if !line.eat(',') {
                return Err(line.expected("`,` or `]` in the placements"));
            }
        }
        Ok(Some(Placements(placements)))
    }

    /// `input|param|state %NAME: TYPE`
    fn input(&mut self, line: &mut Line<'a>, kind: InputKind) -> Result<(), ParseError> {
        self.enter(line, Section::Inputs)?;
        line.advance();
        let (name, col) = line.value_name("an input name `%name`")?;
        if !is_name(name) {
            return Err(line.error(
                col,
                format!("invalid input name `%{name}`: input names start with a letter or `_`"),
            ));
        }
        if self.values.contains_key(name) {
            return Err(line.error(col, format!("duplicate input name `%{name}`")));
        }
        line.expect(':', "after the input name")?;
        let ty = line.tensor_type()?;
        let placement = self.placements(line)?;
        line.expect_end("`@ [placements]` or end of line after the input type")?;
        let value = self.graph.add_input(name, kind, ty);
        self.graph.inputs.last_mut().expect("just added").placement = placement;
        self.values.insert(name, value);
        Ok(())
    }

    /// `%a: TYPE, %b: TYPE = op(%x, %y, key=value)  # META`
    fn node(&mut self, line: &mut Line<'a>) -> Result<(), ParseError> {
        self.enter(line, Section::Nodes)?;
        let mut names = Vec::new();
        let mut types = Vec::new();
        loop {
            let (name, col) = line.value_name("an output value `%v`")?;
            if self.values.contains_key(name) || names.contains(&name) {
                return Err(line.error(col, format!("value `%{name}` is defined twice")));
            }
            line.expect(':', "after the output value")?;
            names.push(name);
            types.push(line.tensor_type()?);
            if line.eat('=') {
                break;
            }
            if !line.eat(',') {
                return Err(line.expected("`,` or `=` after the output type"));
            }
        }

        let (op_name, op_col) = line.word("an op name")?;
        line.expect('(', "after the op name")?;
        let mut inputs = Vec::new();
        let mut attrs: Vec<(String, Attr)> = Vec::new();
        let mut attr_cols = Vec::new();
        if !line.eat(')') {
            loop {
                let what = match line.peek() {
                    Some(Tok::Value(name)) => {
                        let col = line.col();
                        if !attrs.is_empty() {
                            return Err(
                                line.error(col, "operands must come before attributes".into())
                            );
                        }
                        line.advance();
                        inputs.push(self.lookup(line, name, col)?);
                        "operand"
                    }
                    Some(Tok::Word(key)) => {
                        attr_cols.push(line.col());
                        line.advance();
                        line.expect('=', &format!("after the attribute name `{key}`"))?;
                        attrs.push((key.to_string(), line.attr_value()?));
                        "attribute"
                    }
                    _ => return Err(line.expected("an operand `%v` or an attribute `name=value`")),
                };
                if line.eat(')') {
                    break;
                }
                if !line.eat(',') {
                    return Err(line.expected(&format!("`)` or `,` after {what}")));
                }
            }
        }
        let op = Op::from_name_attrs(op_name, &attrs).map_err(|message| {
            // Point at the attribute the message is about, if it names one.
            let col = attrs
                .iter()
                .zip(&attr_cols)
                .find(|((key, _), _)| message.contains(&format!("attribute `{key}`")))
                .map_or(op_col, |(_, &col)| col);
            line.error(col, message)
        })?;

        let meta = if line.eat('#') {
            line.meta()?
        } else {
            Meta::default()
        };
        line.expect_end("`#` and the node's metadata, or end of line")?;

        let outputs = self.graph.push_typed(op, inputs, types, meta);
        self.values.extend(names.into_iter().zip(outputs));
        Ok(())
    }

    /// `output NAME = %v [donates %input]`
    fn output(&mut self, line: &mut Line<'a>) -> Result<(), ParseError> {
        self.enter(line, Section::Outputs)?;
        line.advance();
        let (name, col) = line.word("an output name")?;
        if !is_name(name) {
            return Err(line.error(
                col,
                format!("invalid output name `{name}`: names are a letter or `_` followed by letters, digits, `_` and `.`"),
            ));
        }
        if !self.output_names.insert(name) {
            return Err(line.error(col, format!("output `{name}` is declared twice")));
        }
        line.expect('=', "after the output name")?;
        let (value, col) = line.value_name("a value `%v`")?;
        let value = self.lookup(line, value, col)?;
        let donates = if line.peek() == Some(Tok::Word("donates")) {
            line.advance();
            let (input, col) = line.value_name("the donated input `%name`")?;
            Some(self.lookup(line, input, col)?)
        } else {
            None
        };
        let placement = self.placements(line)?;
        line.expect_end("`donates %input`, `@ [placements]` or end of line")?;
        self.graph.add_output(name, value, donates);
        self.graph.outputs.last_mut().expect("just added").placement = placement;
        Ok(())
    }
}
