// Package docs_test checks the repository's Markdown against the code:
// every exported configuration field and wiring option has a row in
// docs/configuration.md, and every relative link in a *.md file resolves
// to a file (and, for a link into a Markdown file, to one of its
// headings), and no Go snippet uses a call returning several values (a
// value and an error) as one value.
package docs_test

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// root is the repository root, relative to this package's directory.
const root = "../.."

const configDoc = "docs/configuration.md"

// section returns the lines of doc from the heading that contains title
// up to the next heading of any level.
func section(t *testing.T, doc []string, title string) []string {
	t.Helper()
	for i, line := range doc {
		if !strings.HasPrefix(line, "#") || !strings.Contains(line, title) {
			continue
		}
		var out []string
		for _, l := range doc[i+1:] {
			if strings.HasPrefix(l, "#") {
				break
			}
			out = append(out, l)
		}
		return out
	}
	t.Fatalf("%s has no heading containing %s", configDoc, title)
	return nil
}

// hasRow reports whether a table row of lines starts with name in code
// quotes, alone ("| `Name` |") or called ("| `Name(...)` |").
func hasRow(lines []string, name string) bool {
	for _, l := range lines {
		if strings.HasPrefix(l, "| `"+name+"`") || strings.HasPrefix(l, "| `"+name+"(") {
			return true
		}
	}
	return false
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, path))
	require.NoError(t, err)
	return strings.Split(string(b), "\n")
}

// TestConfigReferenceNamesEveryField fails when an exported field of a
// configuration struct has no row in its section of
// docs/configuration.md.
func TestConfigReferenceNamesEveryField(t *testing.T) {
	doc := readLines(t, configDoc)
	for _, c := range []struct {
		title string // the section's heading contains it
		typ   reflect.Type
	}{
		{"`outbox.Config`", reflect.TypeFor[outbox.Config]()},
		{"`outbox.Tables`", reflect.TypeFor[outbox.Tables]()},
		{"`relay.Config`", reflect.TypeFor[relay.Config]()},
		{"`gormrelay.StoreConfig`", reflect.TypeFor[gormrelay.StoreConfig]()},
		{"`gormrelay.FailurePolicyConfig`", reflect.TypeFor[gormrelay.FailurePolicyConfig]()},
		{"`publisher.KafkaConfig`", reflect.TypeFor[publisher.KafkaConfig]()},
		{"`publisher.TransactionalConfig`", reflect.TypeFor[publisher.TransactionalConfig]()},
		{"`pgwal.Config`", reflect.TypeFor[pgwal.Config]()},
		{"`opshttp.Health`", reflect.TypeFor[opshttp.Health]()},
	} {
		lines := section(t, doc, c.title)
		n := 0
		for f := range c.typ.Fields() {
			if !f.IsExported() {
				continue
			}
			n++
			if !hasRow(lines, f.Name) {
				t.Errorf("%s: %s.%s has no row \"| `%s` |\" in the section %s", configDoc, c.typ, f.Name, f.Name, c.title)
			}
		}
		require.Positive(t, n, "%s has no exported field", c.typ)
	}
}

// TestConfigReferenceNamesEveryOption fails when an exported function of
// package gormrelay that returns an option (a type whose name ends in
// Option) has no row in the section on gormrelay's options.
func TestConfigReferenceNamesEveryOption(t *testing.T) {
	lines := section(t, readLines(t, configDoc), "`gormrelay` options")
	fset := token.NewFileSet()
	dir := filepath.Join(root, "gormrelay")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var options []string
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !fn.Name.IsExported() || fn.Type.Results == nil || len(fn.Type.Results.List) != 1 {
				continue
			}
			if id, ok := fn.Type.Results.List[0].Type.(*ast.Ident); ok && strings.HasSuffix(id.Name, "Option") {
				options = append(options, fn.Name.Name)
			}
		}
	}
	require.NotEmpty(t, options, "no option constructor found in gormrelay")
	for _, name := range options {
		if !hasRow(lines, name) {
			t.Errorf("%s: gormrelay.%s has no row \"| `%s(...)` |\" in the section on gormrelay's options", configDoc, name, name)
		}
	}
}

var (
	fence      = regexp.MustCompile("^\\s*(```|~~~)")
	inlineCode = regexp.MustCompile("`[^`]*`")
	link       = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	notSlug    = regexp.MustCompile(`[^a-z0-9 _-]`)
)

// markdown is one Markdown file: its links outside code, and the anchors
// of its headings as GitHub computes them.
type markdown struct {
	links   []string
	anchors map[string]bool
}

func parseMarkdown(t *testing.T, path string) markdown {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	md := markdown{anchors: map[string]bool{}}
	seen := map[string]int{}
	inFence := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		if strings.HasPrefix(line, "#") {
			h := strings.TrimSpace(strings.TrimLeft(line, "#"))
			slug := strings.ReplaceAll(notSlug.ReplaceAllString(strings.ToLower(h), ""), " ", "-")
			if n := seen[slug]; n > 0 {
				md.anchors[slug+"-"+strconv.Itoa(n)] = true
			} else {
				md.anchors[slug] = true
			}
			seen[slug]++
		}
		for _, m := range link.FindAllStringSubmatch(inlineCode.ReplaceAllString(line, ""), -1) {
			md.links = append(md.links, m[1])
		}
	}
	require.NoError(t, sc.Err())
	return md
}

// markdownFiles returns the paths of the repository's Markdown files.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	require.NoError(t, filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	}))
	require.NotEmpty(t, files)
	return files
}

// pending are files that documents link to before they are written.
var pending = map[string]bool{}

// TestMarkdownLinksResolve fails when a relative link in a tracked
// Markdown file points to no file, or to a heading its target does not
// have.
func TestMarkdownLinksResolve(t *testing.T) {
	files := markdownFiles(t)
	parsed := map[string]markdown{}
	get := func(p string) markdown {
		md, ok := parsed[p]
		if !ok {
			md = parseMarkdown(t, p)
			parsed[p] = md
		}
		return md
	}
	checked := 0
	for _, file := range files {
		rel, _ := filepath.Rel(root, file)
		for _, target := range get(file).links {
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			path, anchor, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.Join(filepath.Dir(file), path)
			}
			destRel, _ := filepath.Rel(root, dest)
			if pending[filepath.ToSlash(destRel)] {
				continue
			}
			if _, err := os.Stat(dest); err != nil {
				t.Errorf("%s: link (%s): no such file %s", rel, target, destRel)
				continue
			}
			if anchor != "" && strings.HasSuffix(dest, ".md") && !get(dest).anchors[anchor] {
				t.Errorf("%s: link (%s): %s has no heading with anchor #%s", rel, target, destRel, anchor)
			}
		}
	}
	require.Positive(t, checked, "no relative link found")
}

// snippetPackages are the directories, relative to the repository root,
// whose exported functions the documents' Go snippets call, by package
// name.
var snippetPackages = map[string]string{
	"outbox": ".", "gormrelay": "gormrelay", "relay": "relay", "publisher": "publisher",
	"metrics": "metrics", "ops": "ops", "opshttp": "ops/opshttp", "opsui": "ops/opsui",
	"pgwal": "pgwal", "inbox": "inbox", "outboxtest": "outboxtest", "pgnotify": "pgnotify",
}

// multiResult returns "pkg.Func" for every exported function of
// snippetPackages that returns more than one value.
func multiResult(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	fset := token.NewFileSet()
	for pkg, dir := range snippetPackages {
		entries, err := os.ReadDir(filepath.Join(root, dir))
		require.NoError(t, err)
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, filepath.Join(root, dir, e.Name()), nil, parser.SkipObjectResolution)
			require.NoError(t, err)
			for _, d := range f.Decls {
				fn, ok := d.(*ast.FuncDecl)
				if !ok || fn.Recv != nil || !fn.Name.IsExported() || fn.Type.Results == nil || fn.Type.Results.NumFields() < 2 {
					continue
				}
				out[pkg+"."+fn.Name.Name] = true
			}
		}
	}
	return out
}

var (
	pkgCall = regexp.MustCompile(`\b([a-z]+)\.([A-Z]\w*)\(`)
	// oneValue matches what, before a call, takes a single value: a struct
	// field or map value ("Admin: "), an argument ("f(", "x, "), or an
	// assignment to one variable ("a := ", "a = ").
	oneValue = regexp.MustCompile(`(:|\(|,|^\s*[\w.]+\s*:?=|[^,\s]\s+[\w.]+\s*:?=)\s*$`)
)

// TestDocSnippetsTakeEveryResult fails when a Go snippet in a Markdown file
// uses a call of a function that returns several values (a value and an
// error) where one value goes: as a struct field, an argument, or the
// right side of a one-variable assignment. Such a snippet does not
// compile ("gormrelay.Health{Admin: gormrelay.NewAdmin(db, cfg)}").
func TestDocSnippetsTakeEveryResult(t *testing.T) {
	multi := multiResult(t)
	require.True(t, multi["gormrelay.NewAdmin"], "gormrelay.NewAdmin returns (*Admin, error)")
	checked := 0
	for _, file := range markdownFiles(t) {
		rel, _ := filepath.Rel(root, file)
		if rel == "CHANGELOG.md" {
			continue // quotes what was wrong
		}
		inGo, inFence := false, false
		for i, line := range readLines(t, rel) {
			if fence.MatchString(line) {
				inFence = !inFence
				inGo = inFence && strings.HasPrefix(strings.TrimLeft(strings.TrimSpace(line), "`~"), "go")
				continue
			}
			if !inGo {
				continue
			}
			line, _, _ = strings.Cut(line, "//") // a comment may name a call
			for _, m := range pkgCall.FindAllStringSubmatchIndex(line, -1) {
				name := line[m[2]:m[3]] + "." + line[m[4]:m[5]]
				if !multi[name] {
					continue
				}
				checked++
				if oneValue.MatchString(line[:m[0]]) {
					t.Errorf("%s:%d: %s returns several values but is used as one: %s", rel, i+1, name, strings.TrimSpace(line))
				}
			}
		}
	}
	require.Positive(t, checked, "no call of a function with several results found in a Go snippet")
}
