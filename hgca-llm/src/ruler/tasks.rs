//! The documents and questions of `hgca-llm ruler`, generated from a seed:
//! what is hidden where in the haystack, what is asked, and how an answer
//! is scored (exact match of the numbers or names it gives).

use clap::ValueEnum;

/// The tasks, after RULER (Hsieh et al., 2024), plus the shift task.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Task {
    /// One key, one number; asked for it.
    Single,
    /// Four keys, one number each (three distractors per question); one
    /// question per key.
    Multikey,
    /// Two keys with three numbers each; asked for all of one key's.
    Multivalue,
    /// Four keys; asked for two of them in one question.
    Multiquery,
    /// Chains `VAR A = n`, `VAR B = VAR A`, ...; asked which variables hold n.
    Vartrack,
    /// Two keys near 25% and 75% depth; a two-turn chat asks one, then the
    /// other (and the reverse order): the attention must move back to a
    /// passage it was not reading.
    Shift,
}

impl Task {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Task::Single => "single",
            Task::Multikey => "multikey",
            Task::Multivalue => "multivalue",
            Task::Multiquery => "multiquery",
            Task::Vartrack => "vartrack",
            Task::Shift => "shift",
        }
    }

    /// The instruction before the document.
    pub(crate) fn preamble(self) -> &'static str {
        match self {
            Task::Vartrack => {
                "Some variable assignments (VAR NAME = ...) are hidden in the text below. Remember them: I will ask about them afterwards.\n\n"
            }
            _ => {
                "Some special magic numbers are hidden in the text below. Remember them: I will ask about them afterwards.\n\n"
            }
        }
    }

    /// Answer tokens generated at most per turn (after the answer's
    /// prefix, a five-digit number is about 7 tokens).
    pub(crate) fn max_answer(self) -> usize {
        match self {
            Task::Vartrack => 32,
            Task::Multivalue | Task::Multiquery => 28,
            _ => 12,
        }
    }
}

/// What a right answer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Its first number is this one.
    Number(String),
    /// Its numbers are exactly these, in any order (repeats ignored).
    Numbers(Vec<String>),
    /// Its `VAR`-style names (runs of 5 capitals) are exactly these.
    Names(Vec<String>),
}

impl Expect {
    /// What of `answer` is scored: its first number, its set of numbers,
    /// or its set of names (sorted, without repeats). Two answers are the
    /// same when these are.
    pub(crate) fn extract(&self, answer: &str) -> Vec<String> {
        let set = |mut v: Vec<String>| {
            v.sort();
            v.dedup();
            v
        };
        match self {
            Expect::Number(_) => numbers(answer).into_iter().take(1).collect(),
            Expect::Numbers(_) => set(numbers(answer)),
            Expect::Names(_) => set(names(answer)),
        }
    }

    /// Whether `answer` is right: exactly the expected number, numbers or names.
    pub(crate) fn check(&self, answer: &str) -> bool {
        self.extract(answer) == self.extract(&self.show())
    }

    pub(crate) fn show(&self) -> String {
        match self {
            Expect::Number(n) => n.clone(),
            Expect::Numbers(v) | Expect::Names(v) => v.join(", "),
        }
    }
}

/// The runs of ASCII digits in `s`.
pub(crate) fn numbers(s: &str) -> Vec<String> {
    runs(s, |c| c.is_ascii_digit(), |_| true)
}

/// The runs of exactly five ASCII capitals in `s` (the variables' names).
pub(crate) fn names(s: &str) -> Vec<String> {
    runs(s, |c| c.is_ascii_uppercase(), |r| r.len() == 5)
}

fn runs(s: &str, class: impl Fn(char) -> bool, keep: impl Fn(&str) -> bool) -> Vec<String> {
    s.split(|c: char| !class(c))
        .filter(|r| !r.is_empty() && keep(r))
        .map(str::to_owned)
        .collect()
}

/// One turn of a question: what the user asks, how the assistant's answer
/// begins (given, as RULER does, so that the model answers at once), and
/// what the generated rest must hold.
#[derive(Clone, Debug)]
pub(crate) struct Turn {
    pub(crate) ask: String,
    pub(crate) prefix: String,
    pub(crate) expect: Expect,
}

/// A question about a document: one turn, or several (the shift task).
#[derive(Clone, Debug)]
pub(crate) struct Question {
    pub(crate) turns: Vec<Turn>,
}

/// A document: sentences hidden at depths (fractions of the haystack part,
/// in increasing order of depth), and the questions asked about it.
#[derive(Clone, Debug)]
pub(crate) struct Doc {
    pub(crate) task: Task,
    pub(crate) needles: Vec<(f64, String)>,
    pub(crate) questions: Vec<Question>,
}

/// splitmix64: the documents' randomness, fixed by the seed.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64, task: Task, doc: usize) -> Self {
        let mut r = Rng(seed ^ ((task as u64 + 1) << 40) ^ ((doc as u64) << 8));
        r.next();
        r
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// `k` distinct indices below `n`.
    fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = Vec::with_capacity(k);
        while v.len() < k {
            let i = self.below(n);
            if !v.contains(&i) {
                v.push(i);
            }
        }
        v
    }
}

const ADJ: [&str; 16] = [
    "silver", "quiet", "northern", "crooked", "golden", "hidden", "frozen", "scarlet", "ancient",
    "gentle", "bitter", "hollow", "distant", "velvet", "rusty", "lucky",
];
const NOUN: [&str; 16] = [
    "lantern", "harbour", "orchard", "violin", "compass", "meadow", "anchor", "falcon", "teapot",
    "bridge", "chapel", "saddle", "mirror", "garden", "ribbon", "candle",
];

/// `k` distinct keys such as "the silver lantern".
fn keys(r: &mut Rng, k: usize) -> Vec<String> {
    r.distinct(k, ADJ.len() * NOUN.len())
        .into_iter()
        .map(|i| format!("the {} {}", ADJ[i / NOUN.len()], NOUN[i % NOUN.len()]))
        .collect()
}

/// A five-digit number that is in none of `used`.
fn number(r: &mut Rng, used: &mut Vec<String>) -> String {
    loop {
        let n = (10_000 + r.below(90_000)).to_string();
        if !used.contains(&n) {
            used.push(n.clone());
            return n;
        }
    }
}

/// A five-capital name that is in none of `used`.
fn name(r: &mut Rng, used: &mut Vec<String>) -> String {
    loop {
        let n: String = (0..5).map(|_| (b'A' + r.below(26) as u8) as char).collect();
        if !used.contains(&n) {
            used.push(n.clone());
            return n;
        }
    }
}

/// `k` sorted depths in [0.05, 0.95]: one per equal slice, at random within it.
fn depths(r: &mut Rng, k: usize) -> Vec<f64> {
    let w = 0.9 / k as f64;
    (0..k).map(|i| 0.05 + w * (i as f64 + r.unit())).collect()
}

fn one_number(key: &str) -> (String, String) {
    (
        format!(
            "What is the special magic number for {key} in the text above? Reply with the number only."
        ),
        format!("The special magic number for {key} in the text above is"),
    )
}

fn magic(key: &str, n: &str) -> String {
    format!(" The special magic number for {key} is {n}. ")
}

/// Document `i` of `task`, from `seed`.
pub(crate) fn doc(task: Task, seed: u64, i: usize) -> Doc {
    let mut r = Rng::new(seed, task, i);
    let mut used = Vec::new();
    let mut needles = Vec::new();
    let mut questions = Vec::new();
    let q1 = |(ask, prefix): (String, String), expect: Expect| Question {
        turns: vec![Turn {
            ask,
            prefix,
            expect,
        }],
    };
    match task {
        Task::Single => {
            let (key, n) = (keys(&mut r, 1).remove(0), number(&mut r, &mut used));
            needles.push((0.05 + 0.9 * r.unit(), magic(&key, &n)));
            questions.push(q1(one_number(&key), Expect::Number(n)));
        }
        Task::Multikey | Task::Multiquery => {
            let ks = keys(&mut r, 4);
            let ns: Vec<String> = (0..4).map(|_| number(&mut r, &mut used)).collect();
            // The keys' order in the text is not their order in the questions.
            let order = r.distinct(4, 4);
            for (d, &j) in depths(&mut r, 4).into_iter().zip(&order) {
                needles.push((d, magic(&ks[j], &ns[j])));
            }
            if task == Task::Multikey {
                for (k, n) in ks.iter().zip(&ns) {
                    questions.push(q1(one_number(k), Expect::Number(n.clone())));
                }
            } else {
                for p in [[0, 1], [2, 3]] {
                    questions.push(q1(
                        (
                            format!(
                                "What are the special magic numbers for {} and for {} in the text above? Reply with the two numbers only, separated by a comma.",
                                ks[p[0]], ks[p[1]]
                            ),
                            format!(
                                "The special magic numbers for {} and for {} in the text above are",
                                ks[p[0]], ks[p[1]]
                            ),
                        ),
                        Expect::Numbers(vec![ns[p[0]].clone(), ns[p[1]].clone()]),
                    ));
                }
            }
        }
        Task::Multivalue => {
            let ks = keys(&mut r, 2);
            let ns: Vec<String> = (0..6).map(|_| number(&mut r, &mut used)).collect();
            let order = r.distinct(6, 6);
            for (d, &j) in depths(&mut r, 6).into_iter().zip(&order) {
                needles.push((
                    d,
                    format!(
                        " One of the special magic numbers for {} is {}. ",
                        ks[j / 3],
                        ns[j]
                    ),
                ));
            }
            for (h, k) in ks.iter().enumerate() {
                questions.push(q1(
                    (
                        format!(
                            "What are all the special magic numbers for {k} in the text above? Reply with the numbers only, separated by commas."
                        ),
                        format!("The special magic numbers for {k} in the text above are"),
                    ),
                    Expect::Numbers(ns[3 * h..3 * h + 3].to_vec()),
                ));
            }
        }
        Task::Vartrack => {
            // Two chains of four variables, interleaved in the text; each
            // assignment comes after the one it reads.
            let mut names_used = Vec::new();
            let chains: Vec<(String, Vec<String>)> = (0..2)
                .map(|_| {
                    let n = number(&mut r, &mut used);
                    let vs = (0..4).map(|_| name(&mut r, &mut names_used)).collect();
                    (n, vs)
                })
                .collect();
            let ds = depths(&mut r, 8);
            // Chain c's hop h at depth slot 2h + (c xor a coin).
            let flip = r.below(2);
            for (h, pair) in ds.chunks(2).enumerate() {
                for (c, (n, vs)) in chains.iter().enumerate() {
                    let s = if h == 0 {
                        format!(" VAR {} = {n}. ", vs[0])
                    } else {
                        format!(" VAR {} = VAR {}. ", vs[h], vs[h - 1])
                    };
                    needles.push((pair[c ^ flip], s));
                }
            }
            needles.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (n, vs) in &chains {
                questions.push(q1(
                    (
                        format!(
                            "Which variables in the text above are assigned the value {n}, directly or through other variables? Reply with the variable names only, separated by commas."
                        ),
                        format!(
                            "Following the chain of assignments in the text above, the variables assigned the value {n} are"
                        ),
                    ),
                    Expect::Names(vs.clone()),
                ));
            }
        }
        Task::Shift => {
            let ks = keys(&mut r, 2);
            let ns: Vec<String> = (0..2).map(|_| number(&mut r, &mut used)).collect();
            let (a, b) = (0.2 + 0.1 * r.unit(), 0.7 + 0.1 * r.unit());
            needles.push((a, magic(&ks[0], &ns[0])));
            needles.push((b, magic(&ks[1], &ns[1])));
            let turn = |j: usize| {
                let (ask, prefix) = one_number(&ks[j]);
                Turn {
                    ask,
                    prefix,
                    expect: Expect::Number(ns[j].clone()),
                }
            };
            questions.push(Question {
                turns: vec![turn(0), turn(1)],
            });
            questions.push(Question {
                turns: vec![turn(1), turn(0)],
            });
        }
    }
    needles.sort_by(|a, b| a.0.total_cmp(&b.0));
    Doc {
        task,
        needles,
        questions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Task; 6] = [
        Task::Single,
        Task::Multikey,
        Task::Multivalue,
        Task::Multiquery,
        Task::Vartrack,
        Task::Shift,
    ];

    #[test]
    fn scoring_is_exact() {
        let one = Expect::Number("12345".into());
        assert!(one.check("12345"));
        assert!(one.check("The number is 12345."));
        assert!(!one.check("1"), "the first digit alone is wrong");
        assert!(!one.check("123456"));
        assert!(!one.check("54321, 12345"), "the first number counts");
        assert!(!one.check(""));
        let set = Expect::Numbers(vec!["11111".into(), "22222".into()]);
        assert!(set.check("22222, 11111"));
        assert!(set.check("11111, 22222, 11111"));
        assert!(!set.check("11111"));
        assert!(!set.check("11111, 22222, 33333"));
        let vars = Expect::Names(vec!["ABCDE".into(), "FGHIJ".into()]);
        assert!(
            vars.check("VAR ABCDE, VAR FGHIJ"),
            "VAR itself has 3 letters"
        );
        assert!(vars.check("FGHIJ, ABCDE"));
        assert!(!vars.check("ABCDE"));
        assert!(!vars.check("ABCDE, FGHIJ, KLMNO"));
    }

    #[test]
    fn documents_are_fixed_by_the_seed_and_answerable() {
        for task in ALL {
            for i in 0..20 {
                let d = doc(task, 7, i);
                let again = doc(task, 7, i);
                assert_eq!(d.needles, again.needles, "{task:?} {i}");
                assert_ne!(d.needles, doc(task, 8, i).needles, "{task:?} {i}");
                assert!(d.needles.windows(2).all(|w| w[0].0 <= w[1].0));
                assert!(d.needles.iter().all(|(x, _)| (0.0..=1.0).contains(x)));
                let text: String = d.needles.iter().map(|(_, s)| s.as_str()).collect();
                assert!(!d.questions.is_empty());
                for q in &d.questions {
                    for t in &q.turns {
                        // Every expected value is in the hidden sentences;
                        // a sentence list is not itself a right answer
                        // unless the task asks for all of it.
                        let want = match &t.expect {
                            Expect::Number(n) => vec![n.clone()],
                            Expect::Numbers(v) | Expect::Names(v) => v.clone(),
                        };
                        for w in &want {
                            assert!(text.contains(w.as_str()), "{task:?} {i}: {w} hidden");
                        }
                        assert!(t.expect.check(&t.expect.show()), "{task:?}: {t:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn chains_are_in_text_order_and_the_shift_moves() {
        for i in 0..20 {
            let d = doc(Task::Vartrack, 3, i);
            let pos = |s: &str| d.needles.iter().position(|(_, n)| n.contains(s)).unwrap();
            for q in &d.questions {
                let Expect::Names(vs) = &q.turns[0].expect else {
                    panic!("vartrack asks for names")
                };
                for h in 1..vs.len() {
                    let assign = format!("VAR {} = VAR {}", vs[h], vs[h - 1]);
                    let p = pos(&assign);
                    assert!(pos(&format!("VAR {} =", vs[h - 1])) < p, "{assign}");
                }
            }
            let s = doc(Task::Shift, 3, i);
            assert!(s.needles[0].0 < 0.31 && s.needles[1].0 > 0.69);
            let firsts: Vec<_> = s.questions.iter().map(|q| q.turns[0].ask.clone()).collect();
            assert_ne!(firsts[0], firsts[1], "both orders are asked");
        }
    }
}
