// Package ui_test drives the operator web UI (opsui.UI) in a real
// headless Chromium against each implementation of the operator API: the
// GORM store's Admin on real databases, and the in-memory opsmem.Store.
// It checks the numbers the UI shows, its actions, its refusals and its
// escaping.
//
// The test binary starts one browser for all its tests (each test gets
// its own tab) with a fresh profile, and stops it after the last test.
// The browser is found as $OUTBOX_CHROMIUM, chromium, chromium-browser or
// google-chrome (scripts/chromium.sh installs Debian's chromium); without
// one the tests skip, and fail under CI=true.
package ui_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	// The browser outlives the tests that share it: stop it before the
	// leak check.
	browser.stop()
	if code == 0 {
		if err := goleak.Find(
			goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
			goleak.IgnoreTopFunction("gorm.io/gorm/internal/lru.NewLRU[...].func1"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// sharedBrowser is the test binary's one Chromium, started on first use.
type sharedBrowser struct {
	once    sync.Once
	ctx     context.Context // the browser's context: tabs are made from it
	cancel  func()
	dataDir string
	err     error
	took    time.Duration // the browser's start, logged by the first tab
	logged  sync.Once
}

var browser sharedBrowser

// chromiumPath finds the browser binary.
func chromiumPath() (string, error) {
	if p := os.Getenv("OUTBOX_CHROMIUM"); p != "" {
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no chromium, chromium-browser or google-chrome on PATH and OUTBOX_CHROMIUM unset (bash scripts/chromium.sh installs it)")
}

func (b *sharedBrowser) start() error {
	b.once.Do(func() {
		path, err := chromiumPath()
		if err != nil {
			b.err = err
			return
		}
		// A fresh profile per run; removed in stop.
		if b.dataDir, b.err = os.MkdirTemp("", "outbox-ui-chromium-"); b.err != nil {
			return
		}
		opts := []chromedp.ExecAllocatorOption{
			chromedp.ExecPath(path),
			chromedp.UserDataDir(b.dataDir),
			chromedp.Headless,
			chromedp.NoSandbox,
			chromedp.DisableGPU,
			chromedp.Flag("disable-background-networking", true),
			chromedp.NoFirstRun,
			chromedp.NoDefaultBrowserCheck,
			chromedp.Flag("disable-extensions", true),
			chromedp.Flag("disable-sync", true),
			chromedp.Flag("disable-default-apps", true),
			chromedp.Flag("disable-component-update", true),
			chromedp.Flag("disable-dev-shm-usage", true),
			chromedp.Flag("metrics-recording-only", true),
			chromedp.Flag("password-store", "basic"),
			chromedp.WindowSize(1280, 900),
		}
		start := time.Now()
		alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
		ctx, cancelCtx := chromedp.NewContext(alloc)
		b.ctx = ctx
		b.cancel = func() { cancelCtx(); cancelAlloc() }
		if err := chromedp.Do(ctx); err != nil {
			b.err = fmt.Errorf("start %s: %w", path, err)
		}
		b.took = time.Since(start)
	})
	return b.err
}

func (b *sharedBrowser) stop() {
	if b.cancel != nil {
		b.cancel() // closes the browser and waits for it to exit
	}
	if b.dataDir != "" {
		_ = os.RemoveAll(b.dataDir)
	}
}

// tab opens a new tab of the shared browser for the test, closed at its
// end. Without a browser the test skips, or fails under CI=true.
func tab(t *testing.T) context.Context {
	t.Helper()
	if err := browser.start(); err != nil {
		if dbtest.InCI() {
			t.Fatalf("headless Chromium required in CI: %v", err)
		}
		t.Skipf("headless Chromium unavailable: %v", err)
	}
	browser.logged.Do(func() {
		t.Logf("headless Chromium started in %s (shared by every test of the binary)", browser.took.Round(time.Millisecond))
	})
	ctx, cancel := chromedp.NewContext(browser.ctx)
	t.Cleanup(cancel)
	// Open the tab now, so that a failure names the browser.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("open a browser tab: %v", err)
	}
	// Every wait in the tab polls until its condition holds; the test's
	// own deadline (go test -timeout), less a margin, ends a wait that
	// never succeeds with an error naming it instead of a panic.
	if dl, ok := t.Deadline(); ok {
		var cancelWait context.CancelFunc
		ctx, cancelWait = context.WithDeadline(ctx, dl.Add(-time.Minute))
		t.Cleanup(cancelWait)
	}
	return ctx
}
