//! Rule files: rewrite rules loaded at run time (`--passes rewrite=FILE`), and the syntax the
//! built-in pattern rules are written in.
//!
//! ```text
//! # Rules for layout ops.                       <- comments start with `#`
//! tier 1                                        <- optional, before any rule; default 1
//! [layout]                                      <- topic of the rules below (default `rules`)
//! # (xᵀ)ᵀ → x for matrices                      <- required: the math, on the line above
//! transpose-pair: (transpose (transpose ?x perm=[1,0]) perm=[1,0]) => ?x
//! # x·x → x²
//! square: (mul ?x ?x) => (square ?x) if dtype(?x) == f32 and rank(?x) != 0
//! ```
//!
//! - A rule is `NAME: LEFT => RIGHT [if COND (and COND)*]`, on one line. Names are letters,
//!   digits, `-`, `_` and `.`, unique in the file.
//! - A pattern is a variable `?x` or `(OP OPERAND... KEY=VALUE...)` with the op names and
//!   attributes of the text format; every attribute of the op must be given (a pattern matches
//!   one attribute value, the text format's). The left side must be an op, and every variable on
//!   the right must appear on the left. A variable used twice on the left matches equal values.
//! - Conditions: `dtype(?x)`, `shape(?x)`, `rank(?x)` compared with `==` or `!=` to `f32`,
//!   `[2,3]`, `2`.
//! - Every rule needs a `#` comment on the line directly above it, saying the math: a file of
//!   rewrites is reviewed like code, and the comment is what the review checks the rule against.
//! - Projections of multi-output ops cannot be written; such ops match as a whole.
//!
//! Types: a rule must keep the type of what it rewrites. When the conditions fix the dtype and
//! shape of every variable, both sides are type-checked at load time and a rule that changes the
//! type is refused with an error naming it. Otherwise the check happens at every application:
//! an application whose right side has another type is skipped and listed in the pass report.
//!
//! Tiers: whether a rule is exact in IEEE arithmetic cannot be decided from its text, so the
//! file declares its tier (`tier 1` or `tier 2`) and the `rewrite` pass takes it. The testing
//! helper (`testing::check`) then holds the pass to it: bitwise-equal outputs for tier 1, a
//! tolerance for tier 2, so a non-exact rule in a tier-1 file fails its tests.

use super::analysis::{ClassType, GraphAnalysis};
use super::lang::{parse_attr, GNode};
use super::rule::{Cond, CondKind, Rule, RuleKind};
use crate::pass::Tier;
use egg::{ENodeOrVar, Id, Pattern, PatternAst, RecExpr, Var};
use graphtrain_ir::{Attr, DType, Op, TensorType};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

/// A parsed rule file.
#[derive(Clone, Debug)]
pub struct RuleFile {
    /// The tier the file declares (`tier 1` when it says nothing).
    pub tier: Tier,
    pub rules: Vec<Rule>,
}

/// A rule file that could not be loaded: where and why.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleFileError {
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// 1-based, in characters.
    pub column: usize,
    pub message: String,
}

impl fmt::Display for RuleFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.column, self.message
        )
    }
}

impl std::error::Error for RuleFileError {}

/// Reads and parses the rule file at `path`.
pub fn load_rules(path: &Path) -> Result<RuleFile, RuleFileError> {
    let file = path.display().to_string();
    let src = std::fs::read_to_string(path).map_err(|e| RuleFileError {
        file: file.clone(),
        line: 0,
        column: 0,
        message: format!("cannot read the rule file: {e}"),
    })?;
    parse_rules(&file, &src)
}

/// Parses rule-file text; `file` names it in errors.
pub fn parse_rules(file: &str, src: &str) -> Result<RuleFile, RuleFileError> {
    let mut tier: Option<Tier> = None;
    let mut topic = "rules".to_string();
    let mut rules: Vec<Rule> = Vec::new();
    let mut names: HashSet<String> = HashSet::new();
    let mut math: Option<String> = None;
    for (i, raw) in src.lines().enumerate() {
        let line = i + 1;
        let err = |column: usize, message: String| RuleFileError {
            file: file.to_string(),
            line,
            column,
            message,
        };
        let text = raw.trim_end();
        let indent = text.chars().take_while(|c| c.is_whitespace()).count();
        let body = text.trim_start();
        let comment = math.take();
        if body.is_empty() {
            continue;
        }
        if let Some(c) = body.strip_prefix('#') {
            math = Some(c.trim().to_string());
            continue;
        }
        if let Some(rest) = body.strip_prefix("tier") {
            if rest.is_empty() || rest.starts_with(char::is_whitespace) {
                if !rules.is_empty() || tier.is_some() {
                    return Err(err(
                        indent + 1,
                        "`tier` must come once, before the first rule".into(),
                    ));
                }
                tier = Some(match rest.trim() {
                    "1" => Tier::Preserving,
                    "2" => Tier::Changing,
                    other => {
                        return Err(err(
                            indent + 6,
                            format!("`tier` takes 1 or 2, found `{other}`"),
                        ))
                    }
                });
                continue;
            }
        }
        if let Some(rest) = body.strip_prefix('[') {
            let name = rest.strip_suffix(']').ok_or_else(|| {
                err(
                    indent + body.chars().count(),
                    "a topic line is `[name]`: missing `]`".into(),
                )
            })?;
            if !is_name(name) {
                return Err(err(
                    indent + 2,
                    format!("topic `{name}` must be letters, digits, `-`, `_` or `.`"),
                ));
            }
            topic = name.to_string();
            continue;
        }
        let rule = parse_rule(body, indent, tier.unwrap_or(Tier::Preserving), &topic)
            .map_err(|(col, msg)| err(col, msg))?;
        let Some(math) = comment else {
            return Err(err(
                indent + 1,
                format!(
                    "rule `{}` needs a `# ...` comment on the line above it saying the math \
                     (e.g. `# x * 1 → x`)",
                    rule.name
                ),
            ));
        };
        if !names.insert(rule.name.clone()) {
            return Err(err(
                indent + 1,
                format!("rule `{}` is defined twice", rule.name),
            ));
        }
        rules.push(Rule { math, ..rule });
    }
    Ok(RuleFile {
        tier: tier.unwrap_or(Tier::Preserving),
        rules,
    })
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// An error inside a line: (1-based column, message).
type LineError = (usize, String);

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Open,
    Close,
    Arrow,
    Eq,
    Ne,
    Word(String),
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Open => f.write_str("`(`"),
            Tok::Close => f.write_str("`)`"),
            Tok::Arrow => f.write_str("`=>`"),
            Tok::Eq => f.write_str("`==`"),
            Tok::Ne => f.write_str("`!=`"),
            Tok::Word(w) => write!(f, "`{w}`"),
        }
    }
}

/// Splits `s` (starting at 1-based column `col0`) into tokens with their columns. Inside `[...]`
/// spaces and commas belong to the word, so `perm=[1, 0]` is one token.
fn tokenize(s: &str, col0: usize) -> Result<Vec<(usize, Tok)>, LineError> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let starts = |i: usize, p: &str| chars[i..].iter().take(2).copied().eq(p.chars());
    while i < chars.len() {
        let c = chars[i];
        let col = col0 + i;
        if c.is_whitespace() {
            i += 1;
        } else if c == '(' || c == ')' {
            out.push((col, if c == '(' { Tok::Open } else { Tok::Close }));
            i += 1;
        } else if starts(i, "=>") || starts(i, "==") || starts(i, "!=") {
            let t = match (c, chars[i + 1]) {
                ('=', '>') => Tok::Arrow,
                ('=', '=') => Tok::Eq,
                _ => Tok::Ne,
            };
            out.push((col, t));
            i += 2;
        } else {
            let mut word = String::new();
            let mut depth = 0usize;
            while i < chars.len() {
                let c = chars[i];
                if depth == 0
                    && (c.is_whitespace()
                        || c == '('
                        || c == ')'
                        || starts(i, "=>")
                        || starts(i, "==")
                        || starts(i, "!="))
                {
                    break;
                }
                match c {
                    '[' => depth += 1,
                    ']' if depth == 0 => return Err((col0 + i, "`]` without `[`".into())),
                    ']' => depth -= 1,
                    _ => {}
                }
                if !(depth > 0 && c.is_whitespace()) {
                    word.push(c);
                }
                i += 1;
            }
            if depth > 0 {
                return Err((col, format!("`[` in `{word}` is not closed")));
            }
            out.push((col, Tok::Word(word)));
        }
    }
    Ok(out)
}

struct Tokens {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    /// Column just past the end of the line, for "expected ... at end of line".
    end: usize,
}

impl Tokens {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(_, t)| t)
    }

    fn col(&self) -> usize {
        self.toks.get(self.pos).map_or(self.end, |(c, _)| *c)
    }

    fn next(&mut self, what: &str) -> Result<(usize, Tok), LineError> {
        let t = self.toks.get(self.pos).cloned().ok_or_else(|| {
            (
                self.end,
                format!("expected {what}, found the end of the line"),
            )
        })?;
        self.pos += 1;
        Ok(t)
    }
}

/// A pattern as written, before it becomes an egg pattern.
enum Pat {
    Var(usize, String),
    Op { col: usize, op: Op, args: Vec<Pat> },
}

fn parse_rule(body: &str, indent: usize, tier: Tier, topic: &str) -> Result<Rule, LineError> {
    let Some(colon) = body.find(':') else {
        return Err((
            indent + 1,
            "expected a rule `NAME: LEFT => RIGHT [if COND]`, a `[topic]`, `tier N` or a `#` \
             comment"
                .into(),
        ));
    };
    let name = body[..colon].trim();
    if !is_name(name) {
        return Err((
            indent + 1,
            format!("rule name `{name}` must be letters, digits, `-`, `_` or `.`"),
        ));
    }
    let rest_col = indent + body[..=colon].chars().count() + 1;
    let rest = &body[colon + 1..];
    let mut t = Tokens {
        toks: tokenize(rest, rest_col)?,
        pos: 0,
        end: rest_col + rest.chars().count(),
    };
    let lhs = parse_pat(&mut t)?;
    let lhs_col = match &lhs {
        Pat::Var(col, v) => {
            return Err((
                *col,
                format!("the left side `{v}` is a bare variable; it must be an op pattern"),
            ))
        }
        Pat::Op { col, .. } => *col,
    };
    match t.next("`=>`")? {
        (_, Tok::Arrow) => {}
        (c, other) => return Err((c, format!("expected `=>`, found {other}"))),
    }
    let rhs = parse_pat(&mut t)?;
    let mut left_vars = HashMap::new();
    vars(&lhs, &mut left_vars);
    let mut right_vars = HashMap::new();
    vars(&rhs, &mut right_vars);
    if let Some((v, col)) = first_missing(&right_vars, &left_vars) {
        return Err((
            col,
            format!("variable `{v}` on the right side is not bound by the left side"),
        ));
    }
    let mut conds = Vec::new();
    if t.peek().is_some() {
        match t.next("`if`")? {
            (_, Tok::Word(w)) if w == "if" => {}
            (c, other) => {
                return Err((
                    c,
                    format!("expected `if` or the end of the rule, found {other}"),
                ))
            }
        }
        loop {
            conds.push(parse_cond(&mut t, &left_vars)?);
            match t.peek() {
                None => break,
                Some(Tok::Word(w)) if w == "and" => t.pos += 1,
                Some(other) => {
                    return Err((
                        t.col(),
                        format!("expected `and` or the end of the rule, found {other}"),
                    ))
                }
            }
        }
    }
    let lhs_ast = to_ast(&lhs);
    let rhs_ast = to_ast(&rhs);
    check_types_statically(name, &lhs_ast, &rhs_ast, &conds).map_err(|m| (lhs_col, m))?;
    Ok(Rule {
        name: name.to_string(),
        topic: topic.to_string(),
        tier,
        math: String::new(),
        kind: RuleKind::Pattern {
            lhs: Pattern::new(lhs_ast),
            rhs: rhs_ast,
            conds,
        },
    })
}

fn parse_pat(t: &mut Tokens) -> Result<Pat, LineError> {
    match t.next("a pattern (`?x` or `(op ...)`)")? {
        (col, Tok::Word(w)) if w.starts_with('?') => {
            if w.len() < 2 || !is_name(&w[1..]) {
                return Err((col, format!("bad variable name `{w}`")));
            }
            Ok(Pat::Var(col, w))
        }
        (col, Tok::Word(w)) => Err((
            col,
            format!(
                "`{w}` is not a pattern: write a variable `?x` or an op in parentheses `({w} ...)`"
            ),
        )),
        (open, Tok::Open) => {
            let (col, name) = match t.next("an op name")? {
                (c, Tok::Word(w)) if !w.starts_with('?') && !w.contains('=') => (c, w),
                (c, other) => return Err((c, format!("expected an op name, found {other}"))),
            };
            let mut args = Vec::new();
            let mut attrs: Vec<(String, Attr)> = Vec::new();
            loop {
                match t.peek() {
                    Some(Tok::Close) => {
                        t.pos += 1;
                        break;
                    }
                    Some(Tok::Word(w)) if w.contains('=') => {
                        let c = t.col();
                        let w = w.clone();
                        t.pos += 1;
                        let (k, v) = w.split_once('=').unwrap_or((&w, ""));
                        let v = parse_attr(v).map_err(|e| (c, format!("attribute `{k}`: {e}")))?;
                        attrs.push((k.to_string(), v));
                    }
                    Some(Tok::Arrow | Tok::Eq | Tok::Ne) | None => {
                        return Err((open, format!("`(` of `{name}` is not closed")));
                    }
                    Some(_) => args.push(parse_pat(t)?),
                }
            }
            let op = Op::from_name_attrs(&name, &attrs).map_err(|e| (col, e))?;
            let arity = op.arity();
            let ok = match arity {
                graphtrain_ir::op::Arity::Exactly(n) => args.len() == n,
                graphtrain_ir::op::Arity::AtLeast(n) => args.len() >= n,
            };
            if !ok {
                return Err((
                    col,
                    format!(
                        "`{name}` takes {arity:?} operand(s), the pattern gives {}",
                        args.len()
                    ),
                ));
            }
            Ok(Pat::Op { col, op, args })
        }
        (col, other) => Err((col, format!("expected a pattern, found {other}"))),
    }
}

fn parse_cond(t: &mut Tokens, bound: &HashMap<String, usize>) -> Result<Cond, LineError> {
    const KNOWN: &str = "dtype(?x), shape(?x), rank(?x)";
    let (col, func) = match t.next("a condition")? {
        (c, Tok::Word(w)) => (c, w),
        (c, other) => return Err((c, format!("expected a condition ({KNOWN}), found {other}"))),
    };
    if !matches!(func.as_str(), "dtype" | "shape" | "rank") {
        return Err((
            col,
            format!("unknown condition `{func}`; known conditions: {KNOWN} compared with == or !="),
        ));
    }
    match t.next("`(`")? {
        (_, Tok::Open) => {}
        (c, other) => return Err((c, format!("expected `(` after `{func}`, found {other}"))),
    }
    let (vcol, var) = match t.next("a variable")? {
        (c, Tok::Word(w)) if w.starts_with('?') => (c, w),
        (c, other) => return Err((c, format!("expected a variable like `?x`, found {other}"))),
    };
    if !bound.contains_key(&var) {
        return Err((
            vcol,
            format!("condition on `{var}`, which the left side does not bind"),
        ));
    }
    match t.next("`)`")? {
        (_, Tok::Close) => {}
        (c, other) => return Err((c, format!("expected `)`, found {other}"))),
    }
    let equal = match t.next("`==` or `!=`")? {
        (_, Tok::Eq) => true,
        (_, Tok::Ne) => false,
        (c, other) => return Err((c, format!("expected `==` or `!=`, found {other}"))),
    };
    let (wcol, value) = match t.next("a value")? {
        (c, Tok::Word(w)) => (c, w),
        (c, other) => return Err((c, format!("expected a value, found {other}"))),
    };
    let what = match func.as_str() {
        "dtype" => CondKind::Dtype(DType::from_name(&value).ok_or_else(|| {
            (
                wcol,
                format!("unknown dtype `{value}` (known: f64, f32, bf16, i64, i32, bool)"),
            )
        })?),
        "shape" => match parse_attr(&value) {
            Ok(Attr::Ints(v)) if v.iter().all(|x| *x >= 0) => {
                CondKind::Shape(v.into_iter().map(|x| x as usize).collect())
            }
            _ => return Err((wcol, format!("a shape is written `[2,3]`, found `{value}`"))),
        },
        _ => CondKind::Rank(value.parse().map_err(|_| {
            (
                wcol,
                format!("a rank is a non-negative integer, found `{value}`"),
            )
        })?),
    };
    let var: Var = var
        .parse()
        .map_err(|_| (vcol, format!("bad variable name `{var}`")))?;
    Ok(Cond { var, what, equal })
}

fn vars(p: &Pat, out: &mut HashMap<String, usize>) {
    match p {
        Pat::Var(col, v) => {
            out.entry(v.clone()).or_insert(*col);
        }
        Pat::Op { args, .. } => args.iter().for_each(|a| vars(a, out)),
    }
}

fn first_missing(
    right: &HashMap<String, usize>,
    left: &HashMap<String, usize>,
) -> Option<(String, usize)> {
    let mut missing: Vec<(String, usize)> = right
        .iter()
        .filter(|(v, _)| !left.contains_key(*v))
        .map(|(v, c)| (v.clone(), *c))
        .collect();
    missing.sort_by_key(|(_, c)| *c);
    missing.into_iter().next()
}

fn to_ast(p: &Pat) -> PatternAst<GNode> {
    fn go(p: &Pat, ast: &mut RecExpr<ENodeOrVar<GNode>>) -> Id {
        match p {
            Pat::Var(_, v) => {
                // Names were checked by `parse_pat`, so the parse cannot fail; a fresh variable is
                // still the safe fallback.
                let var: Var = v.parse().unwrap_or_else(|_| Var::from_u32(u32::MAX));
                ast.add(ENodeOrVar::Var(var))
            }
            Pat::Op { op, args, .. } => {
                let children = args.iter().map(|a| go(a, ast)).collect();
                ast.add(ENodeOrVar::ENode(GNode::op(op, children)))
            }
        }
    }
    let mut ast = RecExpr::default();
    go(p, &mut ast);
    ast
}

/// When the conditions pin every variable's dtype and shape, both sides have known types: a rule
/// whose sides differ could never apply correctly, so it is refused now rather than skipped at
/// every match.
fn check_types_statically(
    rule: &str,
    lhs: &PatternAst<GNode>,
    rhs: &PatternAst<GNode>,
    conds: &[Cond],
) -> Result<(), String> {
    let mut pinned: HashMap<Var, (Option<DType>, Option<Vec<usize>>)> = HashMap::new();
    for c in conds.iter().filter(|c| c.equal) {
        let e = pinned.entry(c.var).or_default();
        match &c.what {
            CondKind::Dtype(d) => e.0 = Some(*d),
            CondKind::Shape(s) => e.1 = Some(s.clone()),
            CondKind::Rank(_) => {}
        }
    }
    let mut env: HashMap<Var, TensorType> = HashMap::new();
    for n in lhs.as_ref() {
        if let ENodeOrVar::Var(v) = n {
            match pinned.get(v) {
                Some((Some(d), Some(s))) => {
                    env.insert(*v, TensorType::new(*d, s.clone()));
                }
                _ => return Ok(()),
            }
        }
    }
    let mut analysis = GraphAnalysis::default();
    let left = type_of_ast(&mut analysis, lhs, &env);
    let right = type_of_ast(&mut analysis, rhs, &env);
    if let ClassType::Invalid(why) = &left {
        return Err(format!(
            "rule `{rule}`: the left side never type-checks under its conditions: {why}"
        ));
    }
    if left != right {
        return Err(format!(
            "rule `{rule}` changes the type: the left side is {left}, the right side {right}"
        ));
    }
    Ok(())
}

fn type_of_ast(
    analysis: &mut GraphAnalysis,
    ast: &PatternAst<GNode>,
    env: &HashMap<Var, TensorType>,
) -> ClassType {
    let mut types: Vec<ClassType> = Vec::new();
    for n in ast.as_ref() {
        let t = match n {
            ENodeOrVar::Var(v) => env
                .get(v)
                .map(|t| ClassType::Tensor(t.clone()))
                .unwrap_or_else(|| ClassType::Invalid(format!("{v} has no known type"))),
            ENodeOrVar::ENode(node) => analysis.type_of(node, |i| types[usize::from(i)].clone()),
        };
        types.push(t);
    }
    types
        .pop()
        .unwrap_or_else(|| ClassType::Invalid("empty pattern".into()))
}
