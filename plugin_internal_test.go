package outbox

import (
	"reflect"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// A rule added while writes look their models' rules up is never lost:
// the per-type cache cannot be refilled with the rules from before it.
func TestAddRuleRacingRulesForIsNeverLost(t *testing.T) {
	t.Parallel()
	// Many model types, so that every AddRule has many lookups racing it.
	types := make([]reflect.Type, 256)
	for i := range types {
		types[i] = reflect.StructOf([]reflect.StructField{{Name: "F" + strconv.Itoa(i), Type: reflect.TypeFor[int]()}})
	}
	rule := OnCreate(func(Change[any]) (*Message, error) { return nil, nil })
	const added = 20
	for iter := 0; iter < 10; iter++ {
		p, err := NewPlugin(Config{})
		require.NoError(t, err)
		stop := make(chan struct{})
		var passes atomic.Int64
		var wg sync.WaitGroup
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					for _, typ := range types {
						p.rulesFor(typ)
					}
					passes.Add(1)
					select {
					case <-stop:
						return
					default:
					}
				}
			}()
		}
		for r := 0; r < added; r++ {
			// Add while the lookups run: wait for passes made after it.
			for seen := passes.Load(); passes.Load() < seen+2; {
				runtime.Gosched()
			}
			require.NoError(t, p.AddRule(rule))
		}
		close(stop)
		wg.Wait()
		for _, typ := range types {
			m := p.rulesFor(typ)
			require.NotNil(t, m)
			require.Len(t, m.rules, added, "iteration %d, %s: a rule added during lookups was lost", iter, typ)
		}
	}
}
