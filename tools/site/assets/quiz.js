// The sections' quizzes, answered in the page: a choice (radio buttons) or a number (a text box), checked
// against the answer in the block's data attributes (a self-test, not an exam), then the explanation opens.
// The blocks are written by tools/site/quiz.py at build time; no framework, nothing loaded from the network.
(function () {
  "use strict";

  // The rule of Question.accepts in tools/site/sections.py. `data` holds the block's data attributes (quiz,
  // answer, tolerance, relative); `given` is what the learner picked or typed. A number: commas dropped, then a
  // decimal number within the tolerance (a fraction of the answer where relative is "1"), with a 1e-12 slack.
  // Returns true or false, or null where `given` is not a number at all.
  function accepts(data, given) {
    if (data.quiz === "choice") return given.trim().toUpperCase() === data.answer;
    var s = given.trim().replace(/,/g, "").replace(/[\uff10-\uff19]/g, function (c) {
      return String.fromCharCode(c.charCodeAt(0) - 0xfee0); // full-width digits, as Python's float() reads them
    });
    if (!/^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(s)) return null;
    var value = parseFloat(s), target = parseFloat(data.answer), tol = parseFloat(data.tolerance);
    var allowed = data.relative === "1" ? tol * Math.abs(target) : tol;
    return Math.abs(value - target) <= allowed + 1e-12;
  }

  function say(quiz, ok, text) {
    var result = quiz.querySelector(".zo-quiz-result");
    result.textContent = text;
    result.classList.toggle("zo-quiz-right", ok === true);
    result.classList.toggle("zo-quiz-wrong", ok === false);
    quiz.setAttribute("data-state", ok === true ? "right" : ok === false ? "wrong" : "");
  }

  function check(quiz) {
    var given;
    if (quiz.dataset.quiz === "choice") {
      var picked = quiz.querySelector("input[type=radio]:checked");
      if (!picked) return say(quiz, null, "先选一个选项。");
      given = picked.value;
    } else {
      given = quiz.querySelector(".zo-quiz-number").value;
      if (!given.trim()) return say(quiz, null, "先填一个数。");
    }
    var ok = accepts(quiz.dataset, given);
    if (ok === null) return say(quiz, null, "请填一个数，例如 208 或 1.5。");
    say(quiz, ok, ok ? "正确！下面是解析。" : "不对，再想一想（也可以展开答案看解析）。");
    var details = quiz.querySelector("details");
    if (ok && details) details.open = true;
  }

  if (typeof module !== "undefined") module.exports = { accepts: accepts }; // for the tests, under node
  if (typeof document === "undefined") return;
  window.zoQuizAccepts = accepts; // for make site-check, which compares it with Question.accepts
  document.addEventListener("click", function (e) {
    var button = e.target.closest && e.target.closest(".zo-quiz-check");
    if (button) check(button.closest(".zo-quiz"));
  });
  document.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && e.target.classList && e.target.classList.contains("zo-quiz-number")) {
      e.preventDefault();
      check(e.target.closest(".zo-quiz"));
    }
  });
})();
