package outbox

// Rule is a declarative publish rule; build one with On, OnCreate,
// OnUpdate or OnDelete.
type Rule interface {
	rule() *ruleImpl
}

type ruleImpl struct{}
